"""Collectives over the training workers, that also run on a single worker without a process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_reduce(values: list[float], device: torch.device, op: Any = None) -> list[float]:
    """`values` reduced over every worker (summed unless `op` says otherwise); as given on a single worker."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor.tolist()
