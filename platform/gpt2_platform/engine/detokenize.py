"""Incremental detokenization: text deltas for streaming, and stop-string checks."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Decoding only a suffix keeps the cost per token constant; a few tokens of
# context let byte-level BPE join multi-byte characters correctly.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decode to text we already emitted
        self._read = 0

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (may be empty mid-character)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the next byte
        delta = after[len(before) :]
        self._prefix = max(0, len(self.ids) - _CONTEXT_TOKENS)
        self._read = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: list[str], search_from: int) -> int | None:
    """Index in `text` where the earliest stop string begins, looking at text after `search_from`."""
    best = None
    for stop in stops:
        # A stop string may straddle the previous delta: look back by its length.
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
