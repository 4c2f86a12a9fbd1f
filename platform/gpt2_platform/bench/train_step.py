"""Training-step benchmark: time, tokens/s, MFU and peak memory of one GPU step, per variant.

Every variant runs in the same process on the same random data, so the
baseline and the optimizations are measured side by side. No Ray here: this
isolates the step from data loading and reporting.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch
from torch import nn

from gpt2_platform.bench.plain_gpt2 import PlainStep
from gpt2_platform.model import GPT2, flops_per_token, preset
from gpt2_platform.traces import STEP_PREFIX
from gpt2_platform.train.config import LossImpl, OptimConfig
from gpt2_platform.train.loss import LMLoss
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.step import TrainStep, build_optimizer, lr_at, resolve_precision
from gpt2_platform.train.throughput import mfu, peak_tflops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    name: str
    implementation: str
    """ours; hf-eager (transformers' GPT2LMHeadModel, eager attention); plain (bench/plain_gpt2.py, the
    hand-written anchor, always bf16 + compile)."""
    precision: str
    compile_mode: str = "off"
    gradient_checkpointing: bool = False
    loss: LossImpl | None = None
    """ours: train/loss.py's implementation (logits or fused); None = the model's own logits and loss."""
    vocab_multiple: int = 1
    batch_size: int | None = None
    """Overrides the benchmark's batch size (a variant that fills the card)."""
    triton_ce: bool = False
    """ours, loss=logits: train/cross_entropy.py's kernels for the cross-entropy."""
    float8: bool = False
    """The blocks' linear layers run float8 matmuls (torchao's float8 training, tensorwise scales): measured
    as an option, not a training setting."""


class _LossSettings(TypedDict):
    loss: LossImpl
    vocab_multiple: int


_PADDED: _LossSettings = {"loss": "logits", "vocab_multiple": 128}
_FUSED: _LossSettings = {"loss": "fused", "vocab_multiple": 128}

# The ladder of issue 2: the newcomer's baseline, then one change at a time.
DEFAULT_VARIANTS = [
    Variant("hf fp32 eager (baseline)", "hf-eager", "fp32"),
    Variant("ours fp32", "ours", "fp32"),
    Variant("ours fp32 + compile", "ours", "fp32", "default"),
    Variant("ours bf16", "ours", "bf16"),
    Variant("ours bf16 + compile", "ours", "bf16", "default"),
    Variant("ours fp16 + GradScaler + compile", "ours", "fp16", "default"),
    Variant("ours bf16 + compile + activation checkpointing", "ours", "bf16", "default", gradient_checkpointing=True),
    Variant("plain GPT-2, nanoGPT-style (anchor)", "plain", "bf16", "default"),
    Variant("ours bf16 + compile + padded vocab", "ours", "bf16", "default", **_PADDED),
    Variant("ours bf16 + compile + fused loss", "ours", "bf16", "default", **_FUSED),
    Variant("ours bf16 + compile + padded vocab, batch 32", "ours", "bf16", "default", **_PADDED, batch_size=32),
    Variant("ours bf16 + compile + padded vocab + triton CE", "ours", "bf16", "default", **_PADDED, triton_ce=True),
    Variant(
        "ours bf16 + compile + padded vocab + triton CE, batch 32",
        "ours",
        "bf16",
        "default",
        **_PADDED,
        triton_ce=True,
        batch_size=32,
    ),
    Variant("ours bf16 + compile + padded vocab + float8", "ours", "bf16", "default", **_PADDED, float8=True),
    Variant(
        "ours bf16 + compile + fused loss, batch 32",
        "ours",
        "bf16",
        "default",
        **_FUSED,
        batch_size=32,
    ),
]


@dataclass
class Measurement:
    variant: str
    batch_size: int
    seq_len: int
    step_ms: float
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float | None
    first_step_s: float
    final_loss: float
    resident_before_gib: float | None = None
    """GPU memory still allocated when the variant started (left by earlier ones: should be about 0)."""


class HFForTraining(nn.Module):
    """transformers' GPT2LMHeadModel behind our (inputs, targets) -> (logits, loss) signature."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.hf(input_ids=inputs).logits
        loss = nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build(variant: Variant, preset_name: str, device: torch.device) -> nn.Module:
    config = preset(preset_name)
    if variant.implementation == "ours":
        return GPT2(config).to(device)
    if variant.implementation == "hf-eager":
        from transformers import AutoModelForCausalLM

        from gpt2_platform.checkpoint import hf_config

        hf = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="eager")
        return HFForTraining(hf).to(device)
    raise ValueError(f"unknown implementation {variant.implementation!r}")


def build_step(
    variant: Variant, preset_name: str, batch_size: int, seq_len: int, device: torch.device, num_micro_batches: int = 1
) -> tuple[TrainStep | PlainStep, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The variant's model, wrapping and optimizer as a step, and a fixed random batch of micro-batches."""
    torch.manual_seed(0)
    step: TrainStep | PlainStep
    if variant.implementation == "plain":
        step = PlainStep(preset(preset_name), device)
    else:
        model = build(variant, preset_name, device)
        if variant.float8:
            to_float8(model)
        if isinstance(model, GPT2):
            train_model: nn.Module = parallelize(model, device, variant.compile_mode, variant.gradient_checkpointing)
        else:
            train_model = torch.compile(model) if variant.compile_mode != "off" else model
        optimizer = build_optimizer(model, OptimConfig(), device)
        loss_fn = LMLoss(variant.loss, variant.vocab_multiple, triton_ce=variant.triton_ce) if variant.loss else None
        precision = resolve_precision(variant.precision, device)
        step = TrainStep(train_model, optimizer, precision, device, grad_clip=1.0, loss_fn=loss_fn)
    vocab = preset(preset_name).vocab_size
    tokens = torch.randint(0, vocab, (num_micro_batches, batch_size, seq_len + 1), device=device)
    return step, [(t[:, :-1], t[:, 1:]) for t in tokens]


def to_float8(model: nn.Module) -> None:
    """torchao's float8 training on every linear layer of the blocks (the head is the loss's own matmul)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn.startswith("transformer.h."))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what a measured variant left behind, so the next one starts from the same state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def measure(
    variant: Variant,
    preset_name: str,
    batch_size: int,
    seq_len: int,
    num_steps: int,
    warmup_steps: int,
    device: torch.device,
    num_micro_batches: int = 1,
    profile_dir: Path | None = None,
) -> Measurement:
    """Build, warm up (compiling if asked), then time num_steps optimizer steps.

    With num_micro_batches > 1 each step accumulates that many micro-batches of
    batch_size; tokens/s counts all of them. `profile_dir`: a profiler trace of three more steps goes there.
    """
    batch_size = variant.batch_size or batch_size
    resident_before = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    step, batch = build_step(variant, preset_name, batch_size, seq_len, device, num_micro_batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step(batch, lr=1e-4)
    sync(device)
    first_step_s = time.perf_counter() - start
    for _ in range(warmup_steps):
        step(batch, lr=1e-4)
    sync(device)
    start = time.perf_counter()
    for _ in range(num_steps):
        loss, _ = step(batch, lr=1e-4)
    sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = num_micro_batches * batch_size * seq_len * num_steps / elapsed
    result = Measurement(
        variant=variant.name,
        batch_size=batch_size,
        seq_len=seq_len,
        step_ms=1000 * elapsed / num_steps,
        tokens_per_s=tokens_per_s,
        mfu=mfu(tokens_per_s, flops_per_token(preset(preset_name), seq_len), peak_tflops(device)),
        peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        first_step_s=first_step_s,
        final_loss=loss.item(),
        resident_before_gib=resident_before,
    )
    if profile_dir is not None:
        profile(step, batch, profile_dir / _slug(variant.name))
    del step, batch
    release(device)
    return result


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def profile(step, batch, directory: Path, num_steps: int = 3) -> None:
    """A Chrome trace of `num_steps` more steps in `directory` (jobs/trace_summary.py prints it)."""
    directory.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(num_steps):
            with torch.profiler.record_function(f"{STEP_PREFIX}{i + 1}"):
                step(batch, lr=1e-4)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(directory / "step.pt.trace.json"))


def as_markdown(results: list[Measurement]) -> str:
    baseline = results[0].tokens_per_s
    lines = [
        "| variant | batch x seq | step ms | tokens/s | speedup | MFU | peak GiB | first step s | left before GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu_text = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        mem_text = f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "n/a"
        lines.append(
            f"| {r.variant} | {r.batch_size} x {r.seq_len} | {r.step_ms:.1f} | {r.tokens_per_s:,.0f} | "
            f"{r.tokens_per_s / baseline:.2f}x | {mfu_text} | {mem_text} | {r.first_step_s:.1f} | "
            f"{'n/a' if r.resident_before_gib is None else f'{r.resident_before_gib:.2f}'} |"
        )
    return "\n".join(lines)


def to_json(results: list[Measurement]) -> list[dict]:
    return [asdict(r) for r in results]


def text_batches(path: Path, num_steps: int, batch_size: int, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    """`num_steps` batches of `(batch_size, seq_len + 1)` byte tokens at random offsets of a text file (seed 0):
    real text for loss curves, the same for every variant."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    if data.numel() <= seq_len + 1:
        raise ValueError(f"{path} has {data.numel()} bytes; the loss curve needs more than seq_len + 1 = {seq_len + 1}")
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(num_steps):
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        batches.append(torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).to(device))
    return batches


def loss_curve(
    variant: Variant, preset_name: str, batches: list[torch.Tensor], device: torch.device, optim: OptimConfig
) -> list[float]:
    """The training loss of each step of `variant` from seed 0 over `batches`, under optim's schedule."""
    batch_size, seq_len = batches[0].shape[0], batches[0].shape[1] - 1
    step, _ = build_step(variant, preset_name, batch_size, seq_len, device)
    losses = []
    for number, tokens in enumerate(batches, start=1):
        loss, _ = step([(tokens[:, :-1], tokens[:, 1:])], lr=lr_at(number, optim, len(batches)))
        losses.append(loss.detach())
    curve = torch.stack(losses).float().tolist()
    del step
    release(device)
    return curve


def moving_mean(curve: list[float], at: int, window: int) -> float:
    """The mean of the `window` values up to step `at` (counted from 1), fewer at the start."""
    part = curve[max(0, at - window) : at]
    return sum(part) / len(part)


def curves_as_markdown(curves: dict[str, list[float]], window: int = 10) -> str:
    """Loss at a few steps (mean over the `window` steps up to it), and the largest gap to the first curve."""
    names = list(curves)
    length = len(curves[names[0]])
    points = sorted({min(length, p) for p in (window, 50, 100, 150, 200, length)})

    lines = [
        "| variant | " + " | ".join(f"loss @ {p}" for p in points) + " | largest gap to the first |",
        "|---|" + "---|" * (len(points) + 1),
    ]
    for name in names:
        gap = max(
            abs(moving_mean(curves[name], p, window) - moving_mean(curves[names[0]], p, window))
            for p in range(window, length + 1)
        )
        values = " | ".join(f"{moving_mean(curves[name], p, window):.3f}" for p in points)
        lines.append(f"| {name} | {values} | {gap:.3f} |")
    return "\n".join(lines) + f"\n\n(each figure is the mean loss of the {window} steps up to it)"


def plot_curves(curves: dict[str, list[float]], path: Path, title: str, window: int = 10) -> Path | None:
    """The loss curves (moving mean over `window` steps) in one chart; None without matplotlib (not a
    dependency of the project)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.2))
    for name, curve in curves.items():
        smoothed = [moving_mean(curve, at, window) for at in range(1, len(curve) + 1)]
        axes.plot(range(1, len(curve) + 1), smoothed, label=name, linewidth=1.2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(f"training loss (mean of {window} steps)")
    axes.set_ylim(top=min(6.0, axes.get_ylim()[1]))
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path
