"""gpt2_platform.tokenizer: the offline byte-level tokenizer and load_tokenizer's errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from gpt2_platform import checkpoint
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import BYTE_TOKENIZER, EOS_TOKEN, byte_tokenizer, load_tokenizer, named_tokenizer_class

TEXTS = [
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld, naïve café",
    "日本語のテキスト",
    "emoji 🎉🚀 and a ZWJ family 👩‍👩‍👧",
    "control \x00\x01\x7f bytes",
    "".join(chr(i) for i in range(1, 256)),
]


def _random_unicode(seed: int, length: int = 200) -> str:
    """Text drawn from ASCII, Latin-1, CJK, and astral planes (surrogates excluded)."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x17F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x0, 0x1F)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(length))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_vocabulary_is_256_bytes_plus_eos(tokenizer) -> None:
    assert len(tokenizer) == 257
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_id == 256
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == 256
    # Every byte has its own token, and no two bytes share one.
    assert len(set(tokenizer.convert_ids_to_tokens(list(range(256))))) == 256


@pytest.mark.parametrize("text", TEXTS + [_random_unicode(seed) for seed in range(3)])
def test_ids_are_the_utf8_bytes_and_decode_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_eos_text_is_one_token(tokenizer) -> None:
    assert tokenizer.encode(f"ab{EOS_TOKEN}c") == [97, 98, 256, 99]
    assert tokenizer.decode([97, 256, 98]) == f"a{EOS_TOKEN}b"
    assert tokenizer.decode([97, 256, 98], skip_special_tokens=True) == "ab"


def test_batch_encoding_adds_no_special_tokens(tokenizer) -> None:
    batch = tokenizer(["a", "bc"])["input_ids"]
    assert batch == [[97], [98, 99]]


def test_save_and_load_with_auto_tokenizer_gives_identical_ids(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(reloaded) == 257
    assert reloaded.eos_token_id == 256
    for text in TEXTS + [_random_unicode(7), f"x{EOS_TOKEN}y"]:
        assert reloaded.encode(text) == tokenizer.encode(text)
        assert reloaded.decode(tokenizer.encode(text)) == text


def test_load_tokenizer_byte_and_local_directory(tokenizer, tmp_path: Path) -> None:
    assert load_tokenizer(BYTE_TOKENIZER).encode("hé") == [104, 195, 169]
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("hé") == [104, 195, 169]
    assert loaded.eos_token_id == 256


def test_a_directory_that_names_no_tokenizer_class_loads_through_auto_tokenizer(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path / "tok")
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("tokenizer_class")
    config_path.write_text(json.dumps(config))
    assert named_tokenizer_class(tmp_path / "tok") is None
    assert load_tokenizer(str(tmp_path / "tok")).encode("hé") == [104, 195, 169]


def test_loading_a_checkpoint_and_its_tokenizer_imports_neither_auto_classes_nor_dynamo(tokenizer, tmp_path: Path):
    """Importing them (or torch._dynamo) cost a Ray actor 6-8 s on the GPU machine (transformers 5.17)."""
    model_dir = tmp_path / "model"
    checkpoint.save_pretrained(GPT2(preset("tiny")), model_dir)
    tokenizer.save_pretrained(model_dir)
    code = (
        "import sys; from gpt2_platform.checkpoint import load_pretrained; "
        "from gpt2_platform.tokenizer import load_tokenizer; "
        f"load_pretrained({str(model_dir)!r}); print(load_tokenizer({str(model_dir)!r}).eos_token_id); "
        "print(sorted(n for n in sys.modules if n.startswith(('transformers.models.auto', 'torch._dynamo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["256", "[]"]


def test_load_tokenizer_missing_directory_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"could not load tokenizer '/nonexistent/dir'") as error:
        load_tokenizer("/nonexistent/dir")
    assert "'byte'" in str(error.value)
    assert "local tokenizer directory" in str(error.value)
