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

import torch
from torch import nn

from gpt2_platform.config import OptimConfig
from gpt2_platform.model import GPT2, flops_per_token, preset
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision
from gpt2_platform.train.throughput import mfu, peak_tflops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    name: str
    implementation: str  # "ours" or "hf-eager" (transformers' GPT2LMHeadModel, eager attention)
    precision: str
    compile_mode: str = "off"
    gradient_checkpointing: bool = False


# The ladder of issue 2: the newcomer's baseline, then one change at a time.
DEFAULT_VARIANTS = [
    Variant("hf fp32 eager (baseline)", "hf-eager", "fp32"),
    Variant("ours fp32", "ours", "fp32"),
    Variant("ours fp32 + compile", "ours", "fp32", "default"),
    Variant("ours bf16", "ours", "bf16"),
    Variant("ours bf16 + compile", "ours", "bf16", "default"),
    Variant("ours fp16 + GradScaler + compile", "ours", "fp16", "default"),
    Variant("ours bf16 + compile + activation checkpointing", "ours", "bf16", "default", gradient_checkpointing=True),
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
) -> tuple[TrainStep, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The variant's model, wrapping and optimizer as a TrainStep, and a fixed random batch of micro-batches."""
    torch.manual_seed(0)
    model = build(variant, preset_name, device)
    if isinstance(model, GPT2):
        train_model: nn.Module = parallelize(model, device, variant.compile_mode, variant.gradient_checkpointing)
    else:
        train_model = torch.compile(model) if variant.compile_mode != "off" else model
    optimizer = build_optimizer(model, OptimConfig(), device)
    step = TrainStep(train_model, optimizer, resolve_precision(variant.precision, device), device, grad_clip=1.0)
    vocab = preset(preset_name).vocab_size
    tokens = torch.randint(0, vocab, (num_micro_batches, batch_size, seq_len + 1), device=device)
    return step, [(t[:, :-1], t[:, 1:]) for t in tokens]


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
) -> Measurement:
    """Build, warm up (compiling if asked), then time num_steps optimizer steps.

    With num_micro_batches > 1 each step accumulates that many micro-batches of
    batch_size; tokens/s counts all of them.
    """
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
    )
    del step, batch
    release(device)
    return result


def as_markdown(results: list[Measurement]) -> str:
    baseline = results[0].tokens_per_s
    lines = [
        "| variant | batch x seq | step ms | tokens/s | speedup | MFU | peak GiB | first step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu_text = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        mem_text = f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "n/a"
        lines.append(
            f"| {r.variant} | {r.batch_size} x {r.seq_len} | {r.step_ms:.1f} | {r.tokens_per_s:,.0f} | "
            f"{r.tokens_per_s / baseline:.2f}x | {mfu_text} | {mem_text} | {r.first_step_s:.1f} |"
        )
    return "\n".join(lines)


def to_json(results: list[Measurement]) -> list[dict]:
    return [asdict(r) for r in results]
