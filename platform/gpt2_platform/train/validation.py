"""Validation during training: each rank's share of the fixed validation blocks, and the mean loss over all."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpt2_platform.train.collectives import all_reduce
from gpt2_platform.train.step import TrainStep


@dataclass
class ValidationShard:
    """This rank's share of the fixed validation micro-batches, and the number of forwards every rank runs.

    Under FSDP every forward is a collective (each block's parameters are all-gathered), so every rank must
    run the same number of them: a rank whose share is shorter runs `filler` for the rest and does not count
    its loss.
    """

    batches: list[torch.Tensor]
    num_forwards: int
    filler: torch.Tensor


def validation_batches(
    tokens: np.ndarray | None, micro_batch_size: int, rank: int, world: int
) -> ValidationShard | None:
    """Rank r's share of the complete validation micro-batches (every r-th one); None, on every rank, if
    there is not one complete micro-batch. Every rank gets the same `tokens`, so all agree on the count."""
    if tokens is None:
        return None
    tokens = torch.from_numpy(tokens.astype(np.int64))  # (rows, T + 1); a copy: the object store's array is read-only
    batches = [tokens[i : i + micro_batch_size] for i in range(0, len(tokens) - micro_batch_size + 1, micro_batch_size)]
    if not batches:
        return None
    return ValidationShard(batches[rank::world], num_forwards=math.ceil(len(batches) / world), filler=batches[0])


@torch.no_grad()
def evaluate(model: torch.nn.Module, step_fn: TrainStep, shard: ValidationShard, device: torch.device) -> float:
    """Mean validation loss per token over every rank's batches (the same number of forwards on each rank)."""
    loss_sum, num_tokens = 0.0, 0
    model.eval()
    for i in range(shard.num_forwards):
        counted = i < len(shard.batches)
        tokens = (shard.batches[i] if counted else shard.filler).to(device)
        with step_fn.autocast():
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        if counted:  # the model's loss is the mean over the batch's targets
            loss_sum += loss.item() * tokens[:, 1:].numel()
            num_tokens += tokens[:, 1:].numel()
    model.train()
    total_loss, total_tokens = all_reduce([loss_sum, num_tokens], device)  # every rank's
    return total_loss / total_tokens
