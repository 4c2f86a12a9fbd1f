"""Applied to the single-device model from outside, in a fixed order:
activation checkpointing -> torch.compile -> DDP (the order torchtitan uses).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpt2_platform.model import GPT2, Block

logger = logging.getLogger(__name__)


def apply_activation_checkpointing(model: GPT2) -> None:
    """Recompute every transformer block in backward instead of storing its activations."""
    # torch's wrapper keeps parameter names clean in state_dict() (it strips its own prefix).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply,
    )

    apply(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block),
    )


def parallelize(
    model: GPT2, device: torch.device, compile_mode: str = "off", gradient_checkpointing: bool = False
) -> nn.Module:
    """The model to train: checkpointed, compiled and wrapped in DDP as asked (DDP only if distributed)."""
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    wrapped: nn.Module = model
    if compile_mode != "off":
        wrapped = torch.compile(wrapped, mode=None if compile_mode == "default" else compile_mode)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        wrapped = DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped


def no_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """DDP's gradient all-reduce only when `sync` (the last micro-step of an accumulation)."""
    if sync or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()
