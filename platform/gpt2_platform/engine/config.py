"""The engine's settings, and the bounds of what it accepts of a request's sampling parameters.

`EngineConfig` is the one dataclass that Serve (`args.engine`) and the batch
job (`engine:`) both take: Serve validates it through pydantic, the batch job
through the YAML loader (`gpt2_platform.config_loader.build`), and both show the
`engine.<field>` that `__post_init__` names when a value is wrong. The bounds
are checked by `SamplingParams`, Serve's request schemas and the batch job's
config and rows, so every entry point refuses what the engine would. This
module imports no torch, so the HTTP schemas and the config checks stay light.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Literal

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
DecodeKernels = Literal["auto", "triton", "torch"]

MAX_TEMPERATURE = 2.0
"""Highest sampling temperature: OpenAI's cap, so a client gets the range it knows from every entry point."""
MAX_TOP_K = 2**31 - 1
"""Largest top_k (int32's largest); any top_k from the vocabulary size up already means no limit."""
MAX_SEED = 2**63 - 1
"""Largest sampling seed: seeds live in int64 tensors."""
MAX_LOGPROBS = 5
"""Most alternatives a token's log-probabilities come with: OpenAI's completions API allows 5."""
SAMPLING_MODES = ("greedy", "plain", "filtered")
"""The decode graphs per shape: argmax only, sampling without top-k/top-p, and with them (runner._mode)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    """Sequences decoded together (KV cache slots)."""
    max_seq_len: int | None = None
    """Prompt plus generated tokens per sequence; None: the model's context."""
    dtype: Dtype = "auto"
    """auto (bf16 on a GPU that has it, else fp32), bf16, fp16 or fp32."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (GPU only)."""
    compile: bool | None = None
    """torch.compile the decode step (dynamic shapes: one compilation covers every bucket) before capture:
    with `decode_kernels` triton, only its token pick.

    None: on CUDA with `decode_kernels` torch, where it fuses the modules' small kernels (docs/benchmarks.md,
    "The decode step's GPU time, compiled in different ways"); off with our Triton kernels, where the compiled pick gains a few
    percent a step and costs seconds of every start (engine.default_compile); off on a CPU, where its
    warm-up takes minutes (tools/probes/compile_warmup.py)."""
    decode_kernels: DecodeKernels = "auto"
    """The model's part of a decode step: "triton" (our fused kernels, engine/kernels.py), "torch" (the
    model's own modules, compiled with `compile`), or "auto": triton on CUDA where triton is installed."""
    max_prefill_tokens: int = 4096
    """Prompt tokens admitted per iteration, bounding how long running sequences wait for a prefill."""
    packed_prefill: bool | None = None
    """Run 16 or more prompts admitted together back to back without padding (a batch job's groups; a server's
    under load). None: where it runs, on CUDA in bf16 or fp16 on an Ampere or later GPU; true elsewhere on
    CUDA is refused (flash attention's variable-length kernel takes no fp32); on a CPU it runs one attention
    a prompt."""
    compile_cache_dir: str | None = None
    """Where the engine's process keeps Triton's kernel cache and torch.compile's caches (made if missing).
    A machine that has never run the engine compiles every kernel at warm-up, a large share of a cold
    start; a directory that outlives the machine (shared storage, a persistent volume, beside the model)
    hands the next one its kernels compiled. None: their own defaults (~/.triton/cache and the system's
    temporary directory), which a fresh machine or container starts without."""
    gil_switch_interval_ms: float | None = 0.5
    """Python's thread switch interval for the engine's process, set when the engine starts (it is
    process-wide). The engine's thread needs the GIL for a moment every step, to launch the next one; while
    another thread of its process runs Python (a batch actor tokenizing a block, a replica's event loop),
    the thread waiting for the GIL gets it only after the interval, 5 ms by Python's default, which is
    longer than a decode step: the device idles. None: leave the process's interval as it is."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"engine.max_seq_len must be >= 2 or null (the model's context), got {self.max_seq_len}")
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"engine.dtype must be auto, bf16, fp16 or fp32, got {self.dtype!r}")
        if self.decode_kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"engine.decode_kernels must be auto, triton or torch, got {self.decode_kernels!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"engine.max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.compile_cache_dir is not None and not str(self.compile_cache_dir).strip():
            raise ValueError("engine.compile_cache_dir must be a directory or null (the caches' own defaults), got ''")
        if self.gil_switch_interval_ms is not None and not 0.01 <= self.gil_switch_interval_ms <= 100:
            raise ValueError(
                "engine.gil_switch_interval_ms must be between 0.01 and 100 (Python's default is 5) or null "
                f"(leave the process's own), got {self.gil_switch_interval_ms}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; validated on creation."""

    temperature: float = 1.0
    """Softmax temperature in [0, MAX_TEMPERATURE]; 0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 = no limit."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches top_p, in (0, 1]; 1 = no limit."""
    seed: int | None = None
    """Seed in [0, 2**63) for reproducible draws; None = a random one, chosen by `resolved()` and reported back."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, 2**31 - 1] (0 = no limit), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = no limit), got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1] or null for a random one, got {self.seed!r}")

    def resolved(self) -> SamplingParams:
        """A copy with a concrete seed: this one's, or a fresh random 63-bit one."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(63))
