"""The optimization report ("the ladder"): every training-step variant side by side, plus inference.

Measures with `bench.train_step` and `bench.generation`, then writes report.json,
report.md and a tokens/s bar chart into one folder, and, if asked, a torch.profiler
trace of one variant with a summary of where its time went.
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import torch

from gpt2_platform.bench.train_step import DEFAULT_VARIANTS, Measurement, Variant, build_step, measure, release, sync

logger = logging.getLogger(__name__)

CPU_NOTE = "CPU: MFU and peak memory not measured"


@dataclass(frozen=True)
class LadderStep:
    """One row of the ladder: a train_step Variant and how many micro-batches make one optimizer step."""

    variant: Variant
    num_micro_batches: int = 1

    @property
    def name(self) -> str:
        return self.variant.name


ACCUMULATION = LadderStep(Variant("ours bf16 + compile + grad accumulation x4", "ours", "bf16", "default"), 4)
LADDER = [LadderStep(v) for v in DEFAULT_VARIANTS] + [ACCUMULATION]


def select(only: list[str] | None, ladder: list[LadderStep] = LADDER) -> list[LadderStep]:
    """The ladder steps named by `only` (all of them when it is empty), in ladder order.

    Each entry matches a step's exact name, or else every step whose name contains it.
    """

    def matches(pattern: str) -> set[str]:
        exact = {s.name for s in ladder if s.name == pattern}
        return exact or {s.name for s in ladder if pattern in s.name}

    wanted = set().union(*(matches(o) for o in only)) if only else {s.name for s in ladder}
    chosen = [s for s in ladder if s.name in wanted]
    if not chosen:
        raise ValueError(f"--only {only} matches no variant; choose from: {[s.name for s in ladder]}")
    return chosen


def rows_from_measurements(measurements: list[tuple[Measurement, int]]) -> list[dict]:
    """Report rows (Measurement fields + micro-batches + speedup over the first row, the baseline)."""
    assert measurements, "no measurements to report"
    baseline = measurements[0][0].tokens_per_s
    return [{**asdict(m), "num_micro_batches": n, "speedup": m.tokens_per_s / baseline} for m, n in measurements]


def build_rows(
    ladder: list[LadderStep],
    preset_name: str,
    batch_size: int,
    seq_len: int,
    num_steps: int,
    warmup_steps: int,
    device: torch.device,
) -> list[dict]:
    """Measure each ladder step in this process, in order; the first one is the speedup baseline."""
    measurements = []
    for step in ladder:
        logger.info("measuring %s", step.name)
        result = measure(
            step.variant, preset_name, batch_size, seq_len, num_steps, warmup_steps, device, step.num_micro_batches
        )
        logger.info("%s: %.0f tokens/s", step.name, result.tokens_per_s)
        measurements.append((result, step.num_micro_batches))
    return rows_from_measurements(measurements)


def environment(device: torch.device, command: str) -> dict:
    """What the numbers depend on: the device, the library versions, the date and the command."""
    import platform as stdlib_platform

    import transformers

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({stdlib_platform.processor() or stdlib_platform.machine()})"
    return {
        "device": device_name,
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def _optional(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def to_markdown(
    rows: list[dict], env: dict, inference_markdown: str | None = None, profile_text: str | None = None
) -> str:
    """The report: environment header, the training ladder table, then inference and profile sections."""
    lines = [
        "# Optimization report",
        "",
        f"- device: {env['device']}",
        f"- torch {env['torch']}, transformers {env['transformers']}",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
    ]
    if env.get("device_type") != "cuda":
        lines.append(f"- {CPU_NOTE} (n/a below); timings are CPU timings, not GPU claims.")
    lines += [
        "",
        "## Training step",
        "",
        "| variant | batch x seq x micro | step ms | tokens/s | speedup | MFU | peak GiB | first step (compile) s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['batch_size']} x {r['seq_len']} x {r['num_micro_batches']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x | {_optional(r['mfu'], '{:.1%}')} | "
            f"{_optional(r['peak_mem_gib'], '{:.2f}')} | {r['first_step_s']:.2f} |"
        )
    if inference_markdown:
        lines += ["", "## Inference: transformers generate vs our engine", "", inference_markdown]
    if profile_text:
        lines += ["", "## Profile", "", "```", profile_text, "```"]
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], out_dir: Path) -> Path:
    """A horizontal bar chart of tokens/s, each bar labelled with its speedup; returns the file written."""
    try:
        import matplotlib
    except ImportError:
        # matplotlib is not a dependency of the project, so fall back to a hand-written SVG.
        return _write_svg_chart(rows, out_dir / "report.svg")
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(10, 0.6 * len(rows) + 1.5))
    names = [r["variant"] for r in rows][::-1]
    values = [r["tokens_per_s"] for r in rows][::-1]
    bars = axes.barh(names, values, color="#4c72b0")
    for bar, row in zip(bars, rows[::-1], strict=True):
        axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['speedup']:.2f}x", va="center")
    axes.set_xlabel("tokens/s")
    axes.set_title("Training step throughput")
    figure.tight_layout()
    path = out_dir / "report.png"
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def _write_svg_chart(rows: list[dict], path: Path) -> Path:
    label_w, bar_w, row_h, top = 360, 420, 28, 40
    width, height = label_w + bar_w + 90, top + row_h * len(rows) + 20
    top_value = max(r["tokens_per_s"] for r in rows) or 1.0
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        '<text x="10" y="22" font-size="15">Training step throughput (tokens/s)</text>',
    ]
    for i, r in enumerate(rows):
        y = top + i * row_h
        length = bar_w * r["tokens_per_s"] / top_value
        parts += [
            f'<text x="{label_w - 6}" y="{y + 16}" text-anchor="end">{escape(r["variant"])}</text>',
            f'<rect x="{label_w}" y="{y + 4}" width="{length:.1f}" height="{row_h - 8}" fill="#4c72b0"/>',
            f'<text x="{label_w + length + 4:.1f}" y="{y + 16}">{r["tokens_per_s"]:,.0f} ({r["speedup"]:.2f}x)</text>',
        ]
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return path


def _merged_busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def profile_summary(
    step: LadderStep,
    preset_name: str,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    trace_dir: Path,
    num_steps: int = 3,
) -> dict:
    """Profile num_steps steps of one variant into a TensorBoard trace; top ops and GPU idle fraction."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    train_step, micro_batches = build_step(
        step.variant, preset_name, batch_size, seq_len, device, step.num_micro_batches
    )
    train_step(micro_batches, lr=1e-4)  # compile and allocate outside the profiled window
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_dir.mkdir(parents=True, exist_ok=True)
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=num_steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir)),
    ) as profiler:
        for _ in range(1 + num_steps):
            train_step(micro_batches, lr=1e-4)
            sync(device)
            profiler.step()
    on_gpu = device.type == "cuda"
    sort_key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    averages = profiler.key_averages()
    if on_gpu:
        # Kernels only: the CPU-side ops (aten::mm, ProfilerStep#) also carry the device time of what they
        # launched, so listing them beside their kernels would count the same time twice.
        averages = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    averages = sorted(averages, key=lambda e: getattr(e, sort_key), reverse=True)
    top_ops = [{"name": e.key, "self_us": getattr(e, sort_key), "calls": e.count} for e in averages[:10]]
    idle_fraction = None
    if on_gpu:
        events = profiler.events()
        kernels = [
            (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        wall_us = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
        idle_fraction = 1.0 - _merged_busy_us(kernels) / wall_us if kernels and wall_us > 0 else None
    del train_step, micro_batches
    release(device)
    return {
        "variant": step.name,
        "time_column": "self device time" if on_gpu else "self CPU time",
        "top_ops": top_ops,
        "gpu_idle_fraction": idle_fraction,
        "device_type": device.type,
        "trace_dir": str(trace_dir),
        "trace_files": sorted(str(p) for p in trace_dir.rglob("*") if p.is_file()),
    }


def format_profile(summary: dict) -> str:
    lines = [f"variant: {summary['variant']}", f"top 10 ops by {summary['time_column']}:"]
    lines += [f"  {op['self_us'] / 1000:9.2f} ms  {op['calls']:6d} calls  {op['name']}" for op in summary["top_ops"]]
    if summary["device_type"] != "cuda":
        lines.append("GPU idle fraction: n/a (no GPU)")
    elif summary["gpu_idle_fraction"] is None:
        lines.append("GPU idle fraction: n/a (no kernels recorded)")
    else:
        lines.append(f"GPU idle fraction: {summary['gpu_idle_fraction']:.1%}")
    lines.append(f"trace: {summary['trace_dir']} (tensorboard --logdir {summary['trace_dir']})")
    return "\n".join(lines)


def write_report(
    out_dir: Path, rows: list[dict], env: dict, inference: dict | None = None, profile: dict | None = None
) -> dict[str, Path]:
    """Write report.json, report.md and the chart into out_dir; returns their paths."""
    from gpt2_platform.bench import generation

    out_dir.mkdir(parents=True, exist_ok=True)
    inference_markdown = generation.as_markdown(inference) if inference else None
    profile_text = format_profile(profile) if profile else None
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md"}
    document: dict[str, object] = {"environment": env, "rows": rows, "inference": inference, "profile": profile}
    if env.get("device_type") != "cuda":
        document["note"] = CPU_NOTE
    paths["json"].write_text(json.dumps(document, indent=2, default=str))
    paths["markdown"].write_text(to_markdown(rows, env, inference_markdown, profile_text))
    paths["chart"] = write_chart(rows, out_dir)
    return paths
