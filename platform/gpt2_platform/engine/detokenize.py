"""Incremental detokenization: text deltas for streaming, and stop-string checks."""

from __future__ import annotations

import codecs
import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpt2_platform.tokenizer import byte_level_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Decoding only a suffix keeps the cost per token constant; a few tokens of
# context let byte-level BPE join multi-byte characters correctly.
_CONTEXT_TOKENS = 6


class ByteTable:
    """Each token id's bytes, for byte-level BPE tokenizers (GPT-2's, and the offline one).

    With it, a streamed token costs one incremental UTF-8 decode instead of two calls into the
    tokenizer. At a few hundred running sequences those calls were most of the engine thread's
    time per step, all of it holding the GIL that the server's event loops need too.
    """

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, num_checks: int = 64) -> ByteTable | None:
        """The table, or None unless it decodes random id sequences exactly as the tokenizer does."""
        byte_of = byte_level_vocab()
        token_bytes = []
        for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            if token is not None and all(char in byte_of for char in token):
                token_bytes.append(bytes(byte_of[char] for char in token))
            else:  # a special or added token: decoded as its own text
                token_bytes.append(tokenizer.decode([token_id]).encode())
        table = cls(token_bytes)
        rng = random.Random(0)
        for _ in range(num_checks):
            ids = [rng.randrange(len(token_bytes)) for _ in range(rng.randint(1, 24))]
            if table.decode(ids) != tokenizer.decode(ids):
                logger.info(
                    "tokenizer %s is not plain byte-level BPE: detokenizing through it", type(tokenizer).__name__
                )
                return None
        return table

    def decode(self, ids: list[int]) -> str:
        return b"".join(map(self.token_bytes.__getitem__, ids)).decode("utf-8", errors="replace")


class TableTokenizer:
    """What an engine needs of a plain byte-level BPE tokenizer, without transformers: its size, its EOS
    id, and decoding through its byte table (`ByteTable.of` checked that it decodes as the tokenizer).

    An engine process gets one from its parent (engine/process.py), which loads the tokenizer while
    the process imports torch: the process never imports transformers, seconds of a replica's start.
    """

    def __init__(self, table: ByteTable, eos_token_id: int | None) -> None:
        self.table = table
        self.eos_token_id = eos_token_id

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TableTokenizer | None:
        """None unless `tokenizer` is plain byte-level BPE (then the engine needs the tokenizer itself)."""
        table = ByteTable.of(tokenizer)
        return None if table is None else cls(table, tokenizer.eos_token_id)

    def __len__(self) -> int:
        return len(self.table.token_bytes)

    def decode(self, ids: list[int]) -> str:
        return self.table.decode(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, table: ByteTable | None = None) -> None:
        self.tokenizer = tokenizer
        self.table = table
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decode to text we already emitted
        self._read = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if table else None

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (may be empty mid-character)."""
        self.ids.append(token_id)
        if self._utf8 is not None:
            assert self.table is not None  # the byte decoder is made only with a table
            # Holds back an incomplete character's bytes until the token that completes it.
            delta = self._utf8.decode(self.table.token_bytes[token_id])
            self.text += delta
            return delta
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the next byte
        delta = after[len(before) :]
        self._prefix = max(0, len(self.ids) - _CONTEXT_TOKENS)
        self._read = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], search_from: int) -> int | None:
    """Index in `text` where the earliest stop string begins, looking at text after `search_from`."""
    best = None
    for stop in stops:
        # A stop string may straddle the previous delta: look back by its length.
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
