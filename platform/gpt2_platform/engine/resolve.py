"""What the engine's `auto` and null settings resolve to on this device: dtype, slots, decode kernels,
compiling, and where compiled kernels are cached."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpt2_platform.engine import kernels
from gpt2_platform.engine.config import auto_batch_size
from gpt2_platform.engine.requests import EngineConfig
from gpt2_platform.model import GPT2


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def resolve_max_batch_size(
    config: EngineConfig, model: GPT2, max_seq_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, str]:
    """The engine's slots and why: the number configured, or `auto`'s choice from the device's memory."""
    if config.max_batch_size != "auto":
        return config.max_batch_size, "engine.max_batch_size"
    on_gpu = device.type == "cuda"
    total = free = 0
    weights = 0
    element = torch.empty((), dtype=dtype).element_size()
    if on_gpu:
        free, total = torch.cuda.mem_get_info(device)
        weights = sum(p.numel() for p in model.parameters() if p.device.type != "cuda") * element
    c = model.config
    # Keys and values of every layer for max_seq_len tokens, and the sampler's fp32 rows over the vocabulary.
    per_slot = 2 * c.n_layer * c.n_embd * max_seq_len * element + 4 * c.vocab_size * 4
    return auto_batch_size(on_gpu, total, free, weights, per_slot, config.gpu_memory_share)


def resolve_decode_kernels(name: str, device: torch.device, model_config=None) -> str:
    problem = kernels.unsupported(model_config) if model_config is not None else None
    if name == "auto":
        return "triton" if device.type == "cuda" and kernels.available() and problem is None else "torch"
    if name == "triton" and problem:
        raise ValueError(f"decode_kernels='triton': {problem}; use 'torch' or 'auto'")
    if name == "triton" and not kernels.available():
        raise ValueError("decode_kernels='triton' needs the triton package (pip install triton); or use 'torch'")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "decode_kernels='triton' runs on CUDA GPUs (or in Triton's interpreter, TRITON_INTERPRET=1); "
            f"this engine is on {device.type}: use 'torch' or 'auto'"
        )
    return name


def use_compile_cache(directory: str) -> None:
    """Point this process's Triton kernel cache and torch.compile's (inductor's) caches into `directory`.

    Both read their variable whenever they compile, so this holds for every kernel compiled after it (the
    engine compiles only at warm-up and on first use, after its constructor); the variables also reach
    the processes inductor compiles in.
    """
    root = Path(directory).expanduser().resolve()
    for variable, name in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        path = root / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"engine.compile_cache_dir {directory}: cannot make {path} ({error.strerror}); point it at a "
                "writable directory or set it to null"
            ) from error
        os.environ[variable] = str(path)


def default_compile(device: torch.device, decode_kernels: str) -> bool:
    """What `engine.compile: null` means: compile the model's modules on a GPU, where it fuses a step's
    small kernels; not with our decode kernels, where it would compile only the token pick, which makes
    a step a few percent faster while dynamo's import and traces add seconds to every replica's start
    (docs/benchmarks.md, batch generation); not on a CPU (minutes of warm-up)."""
    return device.type == "cuda" and decode_kernels == "torch"
