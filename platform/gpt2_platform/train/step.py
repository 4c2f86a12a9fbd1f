"""One optimizer step: mixed precision, gradient accumulation, clipping, AdamW, LR schedule.

Which AdamW, and where its states live, is train/optim.py's.

Independent of Ray, so the same step runs in tests, benchmarks and workers.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gpt2_platform.train.config import OptimConfig
from gpt2_platform.train.loss import LossFn
from gpt2_platform.train.optim import clip_gradients, make_optimizer, set_lr
from gpt2_platform.train.parallelize import no_sync

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """How a step computes: the autocast dtype (None = fp32) and whether a GradScaler guards fp16."""

    name: str
    autocast_dtype: torch.dtype | None
    use_grad_scaler: bool


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """'auto' means bf16 on a GPU that supports it and fp32 elsewhere."""
    if requested == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        requested = "bf16" if cuda_bf16 else "fp32"
    if requested == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("train.precision=bf16 but this GPU has no bf16; use fp16 or fp32")
        return Precision("bf16", torch.bfloat16, use_grad_scaler=False)
    if requested == "fp16":
        return Precision("fp16", torch.float16, use_grad_scaler=True)
    if requested == "fp32":
        return Precision("fp32", None, use_grad_scaler=False)
    raise ValueError(f"unknown precision {requested!r}; use auto, bf16, fp16 or fp32")


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Linear warmup to optim.lr over warmup_steps, then cosine decay to min_lr at max_steps, and min_lr after.

    `step` counts from 1 (the step about to be taken). `max_steps` is the schedule's length: a resumed
    run passes the one it started with, whatever its train.max_steps is now.
    """
    if optim.warmup_steps and step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    span = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def build_optimizer(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """optim.name's AdamW with weight decay on matrices and embeddings only; fused kernels where available."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return make_optimizer(groups, optim, device)


class TrainStep:
    """Accumulates micro-batches into one optimizer step; DDP syncs only on the last one.

    `loss_fn` (train/loss.py) is passed to the model to compute the loss from its hidden states; None
    keeps the model's own logits and cross-entropy (what models from elsewhere, such as transformers', do).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        device: torch.device,
        grad_clip: float,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.precision = precision
        self.device = device
        self.grad_clip = grad_clip
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler)

    def autocast(self):
        if self.precision.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.precision.autocast_dtype)

    def __call__(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run forward/backward on each micro-batch and step; returns (mean loss, grad norm) on device."""
        set_lr(self.optimizer, lr)
        num_micro = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with no_sync(self.model, sync=i == num_micro - 1), self.autocast():
                _, loss = (
                    self.model(inputs, targets)
                    if self.loss_fn is None
                    else self.model(inputs, targets, loss_fn=self.loss_fn)
                )
                # Mean over the accumulated batch, as if it were one batch num_micro times as large.
                loss = loss / num_micro
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model, self.optimizer, self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(grad_norm, DTensor):  # sharded gradients (FSDP): the norm of the whole
            grad_norm = grad_norm.full_tensor()
        return loss_sum, grad_norm
