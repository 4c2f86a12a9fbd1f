"""Build the model a run asks for: a preset with fresh weights, or pretrained weights."""

from __future__ import annotations

import dataclasses

from gpt2_platform import checkpoint
from gpt2_platform.lora import apply_lora
from gpt2_platform.model import GPT2, GPT2Config, preset
from gpt2_platform.train.config import ModelConfig


def model_config(config: ModelConfig) -> GPT2Config:
    """The architecture without building weights (reads config.json for pretrained models)."""
    if config.init_from is None:
        return preset(config.preset, dropout=config.dropout)
    directory = checkpoint.resolve(config.init_from, allow_patterns=[checkpoint.CONFIG_NAME])
    return dataclasses.replace(checkpoint.read_config(directory), dropout=config.dropout)


def build_model(config: ModelConfig) -> GPT2:
    """A GPT-2 on CPU in fp32: fresh from a preset, or loaded from init_from; with model.lora, its base frozen
    and adapters added (before a resume loads the checkpoint, whose weights hold the adapters too)."""
    if config.init_from is None:
        model = GPT2(model_config(config))
    else:
        model = checkpoint.load_pretrained(config.init_from)
        if model.config.dropout != config.dropout:
            # Dropout has no weights; rebuild with the run's rate and copy the weights over.
            fresh = GPT2(dataclasses.replace(model.config, dropout=config.dropout))
            fresh.load_state_dict(model.state_dict())
            model = fresh
    if config.lora is not None:
        apply_lora(model, config.lora)
    return model
