"""Incremental detokenization: the byte-table fast path gives exactly what the tokenizer's own decode gives."""

from __future__ import annotations

import pickle
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gpt2_platform import demo_data
from gpt2_platform.engine.detokenize import ByteTable, IncrementalDetokenizer, TableTokenizer
from gpt2_platform.tokenizer import EOS_TOKEN, byte_tokenizer

TEXT = "café naïve — 東京 😀 alice has 3 apples."


def trained_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE with real merges, like GPT-2's, trained here on the demo stories (no download)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([*demo_data.stories(300), TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN)


def word_level() -> PreTrainedTokenizerFast:
    """Not byte-level: words as tokens, joined with spaces by the decoder."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "alice": 1, "has": 2, "apples": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("make", [byte_tokenizer, trained_bpe], ids=["byte", "trained-bpe"])
def test_the_byte_table_streams_exactly_the_tokenizers_text(make) -> None:
    tokenizer = make()
    table = ByteTable.of(tokenizer)
    assert table is not None
    rng = random.Random(1)
    sequences = [tokenizer(TEXT)["input_ids"]] + [
        [rng.randrange(len(tokenizer)) for _ in range(40)]
        for _ in range(20)  # broken characters included
    ]
    for ids in sequences:
        fast = IncrementalDetokenizer(tokenizer, table)
        fast_deltas = [fast.add(i) for i in ids]
        assert "".join(fast_deltas) == fast.text
        # What was streamed, plus a last unfinished character flushed, is the tokenizer's own decode.
        assert fast.text + fast._utf8.decode(b"", final=True) == tokenizer.decode(ids)
    text_ids = tokenizer(TEXT)["input_ids"]
    streamed = IncrementalDetokenizer(tokenizer, table)
    assert "".join(streamed.add(i) for i in text_ids) == TEXT  # multi-byte characters arrive whole


def test_a_tokenizer_that_is_not_byte_level_gets_no_table_and_still_decodes() -> None:
    tokenizer = word_level()
    assert ByteTable.of(tokenizer) is None
    detokenizer = IncrementalDetokenizer(tokenizer, None)
    for token_id in tokenizer("alice has apples")["input_ids"]:
        detokenizer.add(token_id)
    assert detokenizer.text == "alice has apples"


def test_a_table_tokenizer_decodes_as_its_tokenizer_and_travels_without_transformers() -> None:
    """What an engine process gets from its parent instead of the tokenizer (engine/process.py)."""
    tokenizer = trained_bpe()
    table = pickle.loads(pickle.dumps(TableTokenizer.of(tokenizer)))
    assert (len(table), table.eos_token_id) == (len(tokenizer), tokenizer.eos_token_id)
    rng = random.Random(2)
    for ids in [tokenizer(TEXT)["input_ids"]] + [[rng.randrange(len(tokenizer)) for _ in range(30)] for _ in range(10)]:
        assert table.decode(ids) == tokenizer.decode(ids)
    assert TableTokenizer.of(word_level()) is None  # the engine needs such a tokenizer itself
