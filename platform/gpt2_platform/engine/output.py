"""Output processing: a sequence's tokens turned into the text a client sees.

The scheduler (engine.py) decides only what ends a sequence on the device's side: its end-of-text
token and its token budget. Everything about text is here: incremental detokenizing, stop strings
(which end a sequence early), and holding back a tail that could still grow into one. The split is
vLLM's: its engine core emits token ids and its API servers turn them into text, so the per-token
text work runs in the processes that serve HTTP, spread over the machine's cores, and not in the one
process that feeds the GPU. The in-process engine runs the same code on its own thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpt2_platform.engine.detokenize import ByteTable, IncrementalDetokenizer, find_stop
from gpt2_platform.engine.requests import GenerationParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextOutput:
    """One sequence's text as its tokens arrive.

    `add` takes each generated token with what the scheduler knows about it, and returns what to
    emit: the token ids, the new text, and the finish reason (None while the sequence goes on).
    With `incremental` False (and no stop strings) only the first token is announced (no ids, no
    text: a server still learns when its first token came), then nothing until the end, when the
    whole text is decoded at once: detokenizing every token of a large batch costs more host time
    than the device step, and a caller that wants only the result need not pay it.
    """

    __slots__ = ("detokenizer", "tokenizer", "stop", "hold", "incremental", "generated", "emitted_chars", "eos_id")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        byte_table: ByteTable | None,
        params: GenerationParams,
        eos_token_id: int | None,
        incremental: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, byte_table)
        self.stop = tuple(params.stop)
        self.hold = max((len(stop) - 1 for stop in self.stop), default=0)
        self.incremental = incremental or bool(self.stop)
        self.eos_id = None if params.ignore_eos else eos_token_id
        self.generated: list[int] = []
        self.emitted_chars = 0

    def add(self, token: int, last: bool) -> tuple[list[int], str, str | None] | None:
        """Take one generated token; `last`: the scheduler ends the sequence with it (end-of-text or
        token budget). Returns (token ids, text, finish reason) to emit, or None for nothing now."""
        self.generated.append(token)
        is_eos = token == self.eos_id
        if not self.incremental:
            if not last:
                return ([], "", None) if len(self.generated) == 1 else None
            tokens = self.generated[:-1] if is_eos else self.generated
            return tokens, self._final_text(), "stop" if is_eos else "length"
        if is_eos:
            return [], self._final_text(), "stop"
        detokenizer = self.detokenizer
        before = len(detokenizer.text)
        detokenizer.add(token)
        if self.stop:
            cut = find_stop(detokenizer.text, self.stop, before)
            if cut is not None:
                return [token], self._text_until(cut), "stop"
        if last:
            return [token], self._final_text(), "length"
        # Hold back a tail that could still become a stop string.
        return [token], self._text_until(max(self.emitted_chars, len(detokenizer.text) - self.hold)), None

    def _final_text(self) -> str:
        """The text not yet emitted, decoded whole (this also flushes an unfinished character)."""
        ids = self.generated
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        pending = text[self.emitted_chars :]
        self.emitted_chars = len(text)
        return pending

    def _text_until(self, end: int) -> str:
        text = self.detokenizer.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return text
