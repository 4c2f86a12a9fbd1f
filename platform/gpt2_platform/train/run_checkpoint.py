"""A training run's checkpoint directory: what a step writes into it and what a resume reads back.

The weights are a Hugging Face directory (checkpoint.py), beside them the optimizer and GradScaler state,
the step counters and the run's config (file names in train/resume.py, which also decides which
directory is whole enough to resume from). A sharded (FSDP) model is gathered whole first, so a DDP run
and an FSDP run write the same directory. The weights are written in fp32 whatever the run trains them in
(optim.name=adamw_bf16 holds them in bf16), so the export is the same directory for every optimizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gpt2_platform import checkpoint as ckpt
from gpt2_platform.model import GPT2
from gpt2_platform.train.config import Config, dump
from gpt2_platform.train.optim import load_portable_state_dict, portable_state_dict, uses_portable_state
from gpt2_platform.train.parallelize import is_sharded
from gpt2_platform.train.resume import OPTIMIZER_STATE, SCALER_STATE, TRAIN_STATE
from gpt2_platform.train.step import TrainStep


@dataclass
class FullStates:
    """What rank 0 writes where it is not `model.state_dict()` and `optimizer.state_dict()`: a sharded (FSDP)
    model's weights gathered whole, and its optimizer state (or any torchao optimizer's) by parameter name."""

    model: dict[str, torch.Tensor] | None
    optimizer: dict


def gather_full_states(model: GPT2, optimizer: torch.optim.Optimizer) -> FullStates | None:
    """On every rank (collectives): the full state dicts of a sharded model, on the CPU; None for a model
    that is not sharded (every rank already holds it whole) under torch's AdamW. The optimizer's is keyed by
    parameter name, so it loads into any number of workers; torchao's low-bit states are dequantized
    (train/optim.py)."""
    portable = uses_portable_state(optimizer)
    if not is_sharded(model) and not portable:
        return None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options) if is_sharded(model) else None
    if portable:
        return FullStates(weights, portable_state_dict(model, optimizer))
    return FullStates(weights, get_optimizer_state_dict(model, optimizer, options=options))


def load_optimizer_state(model: GPT2, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A checkpoint's optimizer state into this run's optimizer (the same optim.name and offload: the driver
    refuses a change), whatever number of workers wrote it.

    Keyed by parameter name (an FSDP run's, or any torchao optimizer's): placed into any model, sharded or not.
    Keyed by position (a DDP run's `optimizer.state_dict()`): loads into a model that is not sharded.
    """
    if uses_portable_state(optimizer):
        load_portable_state_dict(model, optimizer, state)
        return
    keyed_by_name = any(isinstance(key, str) for key in state.get("state", {}))
    if keyed_by_name:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    elif is_sharded(model):
        raise ValueError(
            "this checkpoint's optimizer state was written by a DDP run (keyed by position); resume it with "
            "scaling.strategy=ddp, or start a new run from its weights (model.init_from)"
        )
    else:
        optimizer.load_state_dict(state)


def save_checkpoint(
    directory: Path, model: GPT2, step_fn: TrainStep, state: dict, config: Config, full: FullStates | None = None
) -> None:
    """Model (Hugging Face format), optimizer, scaler, step and config into one directory; a sharded
    model's from `full` (gathered on every rank beforehand)."""
    weights = full.model if full is not None else None
    if next(model.parameters()).dtype != torch.float32:  # bf16 to fp32 is exact, and resumes exactly
        whole = ckpt.unwrap(model).state_dict() if weights is None else weights
        weights = {name: tensor.float() for name, tensor in whole.items()}
    ckpt.write_weights(model, directory, state_dict=weights)
    torch.save(full.optimizer if full is not None else step_fn.optimizer.state_dict(), directory / OPTIMIZER_STATE)
    if step_fn.precision.use_grad_scaler:
        torch.save(step_fn.scaler.state_dict(), directory / SCALER_STATE)
    (directory / TRAIN_STATE).write_text(json.dumps(state))
    (directory / "config.yaml").write_text(dump(config))


@dataclass
class OptimizerStates:
    """A checkpoint's optimizer (and GradScaler) state, read before the optimizer exists."""

    optimizer: dict
    scaler: dict | None


def read_checkpoint(directory: Path, model: GPT2, device: torch.device) -> OptimizerStates:
    """Load the weights into `model` and read the optimizer state; raises if any file is broken."""
    model.load_state_dict(ckpt.from_hf_state_dict(load_file(str(directory / ckpt.WEIGHTS_NAME))))
    optimizer = torch.load(directory / OPTIMIZER_STATE, map_location=device, weights_only=True)
    scaler = None
    if (directory / SCALER_STATE).exists():
        scaler = torch.load(directory / SCALER_STATE, weights_only=True)
    return OptimizerStates(optimizer, scaler)
