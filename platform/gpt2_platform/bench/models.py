"""The model a benchmark runs: a preset with fresh weights (speed does not depend on what they learned)."""

from __future__ import annotations

from pathlib import Path

from gpt2_platform import checkpoint
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer


def write_model(directory: Path, preset_name: str) -> Path:
    """A preset with fresh weights and the byte tokenizer, as a Hugging Face directory."""
    return checkpoint.save_pretrained(
        GPT2(preset(preset_name)), directory, overwrite=True, extra=lambda d: byte_tokenizer().save_pretrained(d)
    )
