"""Applied to the single-device model from outside, in a fixed order:
activation checkpointing -> torch.compile -> DDP or FSDP (the order torchtitan uses).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from gpt2_platform.model import GPT2, Block

logger = logging.getLogger(__name__)


def apply_activation_checkpointing(model: GPT2, blocks: int | None = None) -> None:
    """Recompute transformer blocks in backward instead of storing their activations: all of them, or the
    first `blocks`. A block that keeps its activations skips a second forward, so on a card with memory to
    spare, checkpointing only as many blocks as needed to fit is faster than checkpointing all."""
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
        check_fn=lambda m: isinstance(m, Block) and (blocks is None or m.attn.layer < blocks),
    )


def parallelize(
    model: GPT2,
    device: torch.device,
    compile_mode: str = "off",
    gradient_checkpointing: bool = False,
    strategy: str = "ddp",
    compute_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    checkpoint_blocks: int | None = None,
) -> nn.Module:
    """The model to train: checkpointed, compiled and wrapped as asked.

    ddp: DDP only if distributed (more than one worker). fsdp: FSDP2's `fully_shard` on every block and
    then the root (which holds the embeddings and the tied head), on any number of workers; the model is
    sharded in place and returned, parameters becoming DTensors. `compute_dtype` (fsdp): the dtype the
    gathered parameters compute in (gradients are reduced in fp32); `cpu_offload`: parameters, gradients
    and optimizer state live in CPU memory between uses.
    """
    if gradient_checkpointing:
        apply_activation_checkpointing(model, checkpoint_blocks)
    if strategy == "fsdp":
        return _fully_shard(model, compile_mode, compute_dtype, cpu_offload)
    if strategy != "ddp":
        raise ValueError(f"strategy must be ddp or fsdp, got {strategy!r}")
    wrapped: nn.Module = model
    if compile_mode != "off":
        wrapped = torch.compile(wrapped, mode=None if compile_mode == "default" else compile_mode)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        wrapped = DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped


def _fully_shard(model: GPT2, compile_mode: str, compute_dtype: torch.dtype | None, cpu_offload: bool) -> GPT2:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("scaling.strategy=fsdp needs torch.distributed initialised (Ray Train's workers have it)")
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in model.transformer.h:
        if compile_mode != "off":  # per block, before sharding: each block compiles once, as torchtitan does
            block.compile(mode=None if compile_mode == "default" else compile_mode)
        fully_shard(block, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `parallelize(strategy="fsdp")`."""
    return isinstance(model, FSDPModule)


def no_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """Gradients reduced across workers only when `sync` (the last micro-step of an accumulation): DDP's
    all-reduce, or FSDP's reduce-scatter (unsharded gradients accumulate locally until then)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if sync or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()
