"""What fits on a smaller card: peak memory and tokens/s of one training worker per memory-saving setup.

Each (model, setup, memory cap) runs in a child process of its own: `set_per_process_memory_fraction`
holds the process to the cap as a smaller card would, and an out-of-memory error ends only that child.
The child trains as the Ray Train workers do (`parallelize`, `TrainStep`, the padded-vocabulary loss),
as a one-process group so that FSDP is the real FSDP2. A setup's `optim` is its OptimConfig (train/optim.py):
torchao's low-bit states, bf16 weights with stochastic rounding, or the optimizer offloaded to the CPU.

`loss_curve` trains a setup on real text instead (no cap): `jobs/bench_memory.py --parity-steps` compares
each setup's loss with the reference setup's (bf16 autocast, fp32 AdamW) from the same init and data.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist


class Setup(TypedDict, total=False):
    """What a memory-saving setup turns on; a key left out is off."""

    checkpointing: bool
    checkpoint_blocks: int
    """With checkpointing: how many blocks recompute (train.checkpoint_blocks); left out, all."""
    fsdp: bool
    offload: bool
    """FSDP's CPU offload (parallelize's `cpu_offload`)."""
    optim: dict[str, Any]
    """OptimConfig's fields, by name."""
    lora: dict[str, Any]
    """LoraConfig's fields, by name: adapters trained over a frozen base (lora.py)."""


SETUPS: dict[str, Setup] = {
    "ddp": {},
    "ddp + checkpointing": {"checkpointing": True},
    "fsdp": {"fsdp": True},
    "fsdp + checkpointing": {"fsdp": True, "checkpointing": True},
    "fsdp + offload": {"fsdp": True, "offload": True},
    "fsdp + offload + checkpointing": {"fsdp": True, "offload": True, "checkpointing": True},
    "ddp + adamw8bit + checkpointing": {"checkpointing": True, "optim": {"name": "adamw8bit"}},
    "ddp + adamw4bit + checkpointing": {"checkpointing": True, "optim": {"name": "adamw4bit"}},
    "ddp + adamw_bf16": {"optim": {"name": "adamw_bf16"}},
    "ddp + adamw_bf16 + checkpointing": {"checkpointing": True, "optim": {"name": "adamw_bf16"}},
    "ddp + offload optimizer + checkpointing": {"checkpointing": True, "optim": {"offload": "optimizer"}},
    "ddp + offload optimizer and gradients + checkpointing": {
        "checkpointing": True,
        "optim": {"offload": "optimizer_and_gradients"},
    },
    "ddp + adamw_bf16 + offload optimizer + checkpointing": {
        "checkpointing": True,
        "optim": {"name": "adamw_bf16", "offload": "optimizer"},
    },
    "ddp + lora r16": {"lora": {"r": 16}},
    "ddp + lora r16 + checkpointing": {"checkpointing": True, "lora": {"r": 16}},
}
REFERENCE_SETUP = "ddp"
"""The loss curves' reference: bf16 autocast over fp32 weights, torch's fp32 AdamW."""


@dataclass
class Run:
    preset: str
    setup: str
    cap_gib: float | None
    fits: bool
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    error: str | None = None


def build_setup(preset_name: str, setup: str, device: torch.device, compile_mode: str = "off"):
    """The setup's model (seed 0), wrapped and stepped as a Ray Train worker would: a TrainStep."""
    from gpt2_platform.lora import LoraConfig, apply_lora
    from gpt2_platform.model import GPT2, preset
    from gpt2_platform.train.config import OptimConfig
    from gpt2_platform.train.loss import LMLoss
    from gpt2_platform.train.optim import precision_for, weights_dtype
    from gpt2_platform.train.parallelize import parallelize
    from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

    options = SETUPS[setup]
    optim = OptimConfig(**options.get("optim", {}))
    torch.manual_seed(0)
    with device:  # built on the GPU: initialising 1.5B parameters on the CPU takes longer than the run
        model = GPT2(preset(preset_name))
    if "lora" in options:  # as train/loading.py does: before the dtype, checkpointing, compile and DDP
        apply_lora(model, LoraConfig(**options["lora"]))
    model.to(weights_dtype(optim))
    precision = resolve_precision(precision_for(optim, "bf16"), device)
    train_model = parallelize(
        model,
        device,
        compile_mode,
        options.get("checkpointing", False),
        "fsdp" if options.get("fsdp") else "ddp",
        precision.autocast_dtype,
        options.get("offload", False),
        options.get("checkpoint_blocks"),
    )
    optimizer = build_optimizer(model, optim, device)
    return model, TrainStep(train_model, optimizer, precision, device, 1.0, loss_fn=LMLoss("logits", 128))


def run_one(
    preset_name: str,
    setup: str,
    cap_gib: float | None,
    batch_size: int,
    seq_len: int,
    steps: int,
    compile_mode: str,
    profile_dir: Path | None = None,
    grad_accum: int = 1,
) -> Run:
    """In this process: train `steps` steps (after one untimed) under the cap; the peaks and the speed.

    A step takes `grad_accum` micro-batches before its optimizer update, as a recipe's train.grad_accum_steps
    does: the update's cost is paid once a step, so a setup whose optimizer is slow (the low-bit ones) is
    timed at the accumulation it ships with.

    With `profile_dir`, two more steps after the timed ones are profiled into a trace there (jobs/trace_summary.py
    reads it): where a setup's step time goes, kernel by kernel, is what says how to make it faster."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if cap_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        model, step = build_setup(preset_name, setup, device, compile_mode)
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), device=device)
        batch = [(tokens[:, :-1], tokens[:, 1:])] * grad_accum
        step(batch, lr=1e-4)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss, _ = step(batch, lr=1e-4)
        loss.item()
        elapsed = time.perf_counter() - start
        if profile_dir is not None:
            profile_steps(step, batch, profile_dir / f"{preset_name}-{slug(setup)}-{cap_gib or 'nocap'}")
        return Run(
            preset_name,
            setup,
            cap_gib,
            fits=True,
            peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
            tokens_per_s=batch_size * seq_len * grad_accum * steps / elapsed,
            step_s=elapsed / steps,
        )
    except torch.cuda.OutOfMemoryError as error:
        return Run(preset_name, setup, cap_gib, fits=False, error=str(error).splitlines()[0][:160])
    finally:
        dist.destroy_process_group()


def slug(setup: str) -> str:
    """A setup's name as a file name: "ddp + lora r16" -> "ddp_lora_r16"."""
    return "_".join(part for part in setup.replace("+", " ").split())


def profile_steps(step: Any, batch: list[tuple[torch.Tensor, torch.Tensor]], name: Path, steps: int = 2) -> Path:
    """`steps` training steps under torch's profiler (CPU and CUDA), written as `name`.pt.trace.json."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    name.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            loss, _ = step(batch, lr=1e-4)
        loss.item()
    path = name.with_name(name.name + ".pt.trace.json")
    profiler.export_chrome_trace(str(path))
    return path


def loss_curve(preset_name: str, setup: str, batches: list[torch.Tensor], compile_mode: str) -> list[float]:
    """In this process, on the GPU if there is one: the setup's training loss at each step over `batches`
    (seed 0, the default OptimConfig's schedule over len(batches) steps)."""
    from gpt2_platform.train.config import OptimConfig
    from gpt2_platform.train.step import lr_at

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    try:
        _, step = build_setup(preset_name, setup, device, compile_mode)
        losses = []
        for number, tokens in enumerate(batches, start=1):
            tokens = tokens.to(device)
            loss, _ = step([(tokens[:, :-1], tokens[:, 1:])], lr=lr_at(number, OptimConfig(), len(batches)))
            losses.append(loss.detach())
        return torch.stack(losses).float().tolist()
    finally:
        dist.destroy_process_group()


def final_loss(curve: list[float], window: int = 10) -> float:
    """The mean loss of the last `window` steps: one step's loss is too noisy to compare."""
    return sum(curve[-window:]) / len(curve[-window:])


def parity_as_markdown(curves: dict[str, list[float]], tolerance: float = 0.01) -> str:
    """Each setup's final loss against the reference's, and whether it is within `tolerance` (relative)."""
    reference = final_loss(curves[REFERENCE_SETUP])
    lines = ["| setup | final loss | vs reference | within 1% |", "|---|---|---|---|"]
    for setup, curve in curves.items():
        gap = final_loss(curve) / reference - 1
        lines.append(
            f"| {setup} | {final_loss(curve):.4f} | {100 * gap:+.2f}% | {'yes' if abs(gap) <= tolerance else 'no'} |"
        )
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(script: Path, preset_name: str, setup: str, args: list[str]) -> tuple[dict | None, str]:
    """`script --one ...` in a fresh process (a cap, an out-of-memory and compile's caches stay there): the
    JSON line it printed, or None and the tail of what it said."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    command = [sys.executable, str(script), "--one", preset_name, setup, *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return None, f"child exited {done.returncode}: {' | '.join(tail)}"


def run_in_child(script: Path, preset_name: str, setup: str, cap_gib: float | None, args: list[str]) -> Run:
    """One memory run in a child process."""
    found, error = child(script, preset_name, setup, [*args, *(["--cap-gib", str(cap_gib)] if cap_gib else [])])
    return Run(**found) if found is not None else Run(preset_name, setup, cap_gib, fits=False, error=error)


def smallest_cap(script: Path, preset_name: str, setup: str, caps: list[float], args: list[str], log) -> list[Run]:
    """Try the caps from the smallest up; the first that trains is the smallest card that fits."""
    runs = []
    for cap in sorted(caps):
        run = run_in_child(script, preset_name, setup, cap, args)
        log(run)
        runs.append(run)
        if run.fits:
            break
    return runs


def _cap(run: Run) -> float:
    if run.cap_gib is None:
        raise ValueError(f"{run.preset}, {run.setup}: the table takes runs held to a memory cap; this one had none")
    return run.cap_gib


def as_markdown(runs: list[Run], caps: list[float]) -> str:
    """One row per (model, setup): the smallest cap it trained under, its peaks and speed there."""
    lines = [
        "| model | setup | "
        + " | ".join(f"fits {c:g} GB" for c in sorted(caps, reverse=True))
        + " | peak allocated GiB | "
        "peak reserved GiB | tokens/s | step s |",
        "|---|---|" + "---|" * (len(caps) + 4),
    ]
    keys = list(dict.fromkeys((r.preset, r.setup) for r in runs))
    for preset_name, setup in keys:
        mine = [r for r in runs if (r.preset, r.setup) == (preset_name, setup)]
        fitted = [r for r in mine if r.fits]
        smallest = min((_cap(r) for r in fitted), default=None)
        cells = []
        for cap in sorted(caps, reverse=True):
            tried = [r for r in mine if r.cap_gib == cap]
            if smallest is not None and cap >= smallest:
                cells.append("yes")
            elif tried:
                cells.append("no (OOM)" if not tried[0].fits else "yes")
            else:
                cells.append("?")
        best = min(fitted, key=_cap) if fitted else None
        figures = (
            f"{best.peak_allocated_gib:.1f} | {best.peak_reserved_gib:.1f} | {best.tokens_per_s:,.0f} | {best.step_s:.2f}"
            if best
            else "- | - | - | -"
        )
        lines.append(f"| {preset_name} | {setup} | " + " | ".join(cells) + f" | {figures} |")
    return "\n".join(lines)


def to_json(runs: list[Run]) -> list[dict]:
    return [asdict(r) for r in runs]


def write(path: Path, runs: list[Run]) -> None:
    path.write_text(json.dumps(to_json(runs), indent=2))
