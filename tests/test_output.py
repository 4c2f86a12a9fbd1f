"""Output processing (engine/output.py): a sequence's tokens as the text a client sees."""

from __future__ import annotations

from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.output import TextOutput
from gpt2_platform.engine.requests import GenerationParams
from gpt2_platform.tokenizer import byte_tokenizer


def _output(incremental: bool, stop: tuple[str, ...] = ()) -> TextOutput:
    tokenizer = byte_tokenizer()
    params = GenerationParams(max_tokens=16, stop=stop, ignore_eos=True)
    return TextOutput(tokenizer, ByteTable.of(tokenizer), params, tokenizer.eos_token_id, incremental)


def test_whole_text_output_announces_only_the_first_token_then_gives_the_text_at_the_end():
    output = _output(incremental=False)
    tokens = list(b"hello")
    emitted = [output.add(token, last=i == len(tokens) - 1) for i, token in enumerate(tokens)]
    assert emitted[0] == ([], "", None), "a server learns when the first token came"
    assert emitted[1:-1] == [None] * 3
    assert emitted[-1] == (tokens, "hello", "length")


def test_incremental_output_streams_text_and_a_stop_string_ends_it_without_the_stop():
    output = _output(incremental=True, stop=("lo",))
    texts = []
    for token in b"hello":
        ids, text, reason = output.add(token, last=False)
        texts.append(text)
        if reason is not None:
            break
    assert "".join(texts) == "hel" and reason == "stop"
