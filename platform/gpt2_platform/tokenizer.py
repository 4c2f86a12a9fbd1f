"""Tokenizers: GPT-2's BPE from a directory or the hub, and an offline byte-level one.

The byte-level tokenizer is a real Hugging Face fast tokenizer (built with the
`tokenizers` library: byte-level pre-tokenization, no merges), so it saves
with `save_pretrained` and loads back with `AutoTokenizer.from_pretrained`,
like any other. It needs no download: 256 byte tokens plus `<|endoftext|>`.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Imported where used: an engine process that gets its tokenizer as a byte table from its parent
    # (engine/process.py) never imports transformers, seconds of a replica's start.
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BYTE_TOKENIZER = "byte"
EOS_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def byte_level_vocab() -> dict[str, int]:
    """GPT-2's byte -> printable character table, as token -> id (id = the byte's value).

    The tokenizers ByteLevel pre-tokenizer and decoder use this same table.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    vocab = {chr(b): b for b in printable}
    shifted = 256
    for b in range(256):
        if b not in vocab.values():
            vocab[chr(shifted)] = b
            shifted += 1
    return vocab


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer with 257 ids: bytes 0..255 and <|endoftext|> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(byte_level_vocab())
    vocab[EOS_TOKEN] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=1024,
    )


def named_tokenizer_class(directory: Path) -> type[PreTrainedTokenizerBase] | None:
    """The tokenizer class a local directory's tokenizer_config.json names, if transformers has it.

    What AutoTokenizer does first, without importing transformers' auto classes: with transformers
    5.17 that import brings in its generation stack (torch._dynamo, sympy, scikit-learn where
    installed), seconds of every Ray actor's start-up (docs/benchmarks.md, a Serve replica's start).
    None (then AutoTokenizer decides) for a hub name or a directory that names no class.
    """
    import transformers
    from transformers import PreTrainedTokenizerBase

    try:
        name = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    found = getattr(transformers, name, None) if isinstance(name, str) else None
    return found if isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase) else None


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """'byte' for the offline tokenizer, else a local directory or hub name (e.g. openai-community/gpt2)."""
    if name_or_path == BYTE_TOKENIZER:
        return byte_tokenizer()
    try:
        tokenizer_class = named_tokenizer_class(Path(name_or_path).expanduser())
        if tokenizer_class is not None:
            tokenizer = tokenizer_class.from_pretrained(name_or_path)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # transformers raises OSError, ValueError or hub errors here
        raise ValueError(
            f"could not load tokenizer {name_or_path!r} ({type(error).__name__}: {error}); "
            f"pass a local tokenizer directory, a reachable hub name, or 'byte' for the offline tokenizer"
        ) from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token; documents are separated by it")
    return tokenizer
