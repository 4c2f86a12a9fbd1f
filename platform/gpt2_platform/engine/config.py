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

from gpt2_platform.engine.modes import Pick

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
AUTO_MAX_BATCH_SIZE = 256
"""The most slots `max_batch_size: auto` takes on a GPU. Past it a served engine gains little: a decode
step's time grows with the batch (it reads every live sequence's cache), so each stream's tokens come
slower while the HTTP path in front of one engine, not the engine, bounds what clients get (the serving
benchmark in docs/benchmarks.md measures both). A batch job that wants more sets a number."""
AUTO_CPU_BATCH_SIZE = 16
"""`max_batch_size: auto` on a CPU: a CPU's step grows with the batch about linearly, so a small batch
keeps each step (and `make demo`) short."""
WORKSPACE_BYTES = 1 << 30
"""GPU memory `max_batch_size: auto` leaves beside the weights and the cache: CUDA graphs' pools, the
sampler's and prefill's buffers, the allocator's slack."""
SAMPLING_MODES: tuple[Pick, ...] = tuple(Pick)
"""The picks a step makes, one decode graph per shape each (engine/modes.py): argmax only, sampling without
top-k/top-p, and with them; the names warm-up takes."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int | Literal["auto"] = "auto"
    """Sequences decoded together (KV cache slots). "auto": on a GPU, as many as fit in `gpu_memory_share`
    of the card after the weights and a workspace, at most AUTO_MAX_BATCH_SIZE; on a CPU,
    AUTO_CPU_BATCH_SIZE. The engine logs what it chose and why, and `/v1/engine/stats` shows it."""
    gpu_memory_share: float = 0.9
    """The share of the GPU's memory the engine may hold in all (weights, KV cache, workspace) when it sizes
    its batch itself, as vLLM's gpu_memory_utilization: less leaves room for another replica or process
    on the same card."""
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

    @property
    def max_slots(self) -> int:
        """The most slots an engine of this config may take: the number set, or auto's cap. What a
        deployment sizes its queues and call limits by before any engine has sized itself."""
        return AUTO_MAX_BATCH_SIZE if self.max_batch_size == "auto" else self.max_batch_size

    def __post_init__(self) -> None:
        if self.max_batch_size != "auto" and (
            isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1
        ):
            raise ValueError(f"engine.max_batch_size must be auto or an integer >= 1, got {self.max_batch_size!r}")
        if not 0.05 <= self.gpu_memory_share <= 1.0:
            raise ValueError(f"engine.gpu_memory_share must be in [0.05, 1], got {self.gpu_memory_share}")
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


def auto_batch_size(
    on_gpu: bool,
    total_bytes: int,
    free_bytes: int,
    weights_to_load_bytes: int,
    bytes_per_slot: int,
    share: float,
) -> tuple[int, str]:
    """`max_batch_size: auto`'s choice and why, from the GPU's memory: `free_bytes` as it is now (other
    processes and whatever this one holds already are gone from it), `weights_to_load_bytes` still to come.
    ValueError when not one sequence fits."""
    if not on_gpu:
        return AUTO_CPU_BATCH_SIZE, f"auto on a CPU: {AUTO_CPU_BATCH_SIZE}"
    gib = 2**30
    held_elsewhere = total_bytes - free_bytes
    budget = share * total_bytes - held_elsewhere - weights_to_load_bytes - WORKSPACE_BYTES
    fits = int(budget // bytes_per_slot) if budget > 0 else 0
    where = (
        f"{share:g} of {total_bytes / gib:.1f} GiB, less {held_elsewhere / gib:.1f} GiB in use, "
        f"{weights_to_load_bytes / gib:.1f} GiB of weights and {WORKSPACE_BYTES / gib:.1f} GiB of workspace, "
        f"at {bytes_per_slot / 2**20:.1f} MiB of KV cache a sequence"
    )
    if fits < 1:
        raise ValueError(
            f"engine.max_batch_size auto: not one sequence fits ({where}); lower engine.max_seq_len, raise "
            "engine.gpu_memory_share, or free the GPU"
        )
    if fits > AUTO_MAX_BATCH_SIZE:
        return AUTO_MAX_BATCH_SIZE, f"auto: {fits} fit ({where}), capped at {AUTO_MAX_BATCH_SIZE}"
    return fits, f"auto: {fits} fit ({where})"


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
