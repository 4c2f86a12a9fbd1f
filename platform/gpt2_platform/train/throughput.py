"""Throughput figures: tokens/s, model FLOPs utilization, peak GPU memory."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak of one GPU, TFLOP/s, from the vendors' data sheets
# (without sparsity). Matched as substrings of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16; V100 has no bf16
    "T4": 65.0,  # fp16; T4 has no bf16
}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The card's peak dense bf16 TFLOP/s, or None on CPU and unknown cards (MFU is then not reported)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    logger.warning("unknown GPU %r: set train.peak_tflops to report MFU", name)
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1] (PaLM's definition: achieved model FLOP/s over peak)."""
    if peak is None:
        return None
    return tokens_per_s_per_device * flops_per_token / (peak * 1e12)


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory allocated by torch on this GPU since the last reset, in GiB."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
