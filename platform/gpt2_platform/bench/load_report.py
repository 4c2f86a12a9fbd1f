"""The load sweep's report: a markdown table row per level, the lines printed as each level ends, the
comparison with the engine alone, and the chart (matplotlib, optional)."""

from __future__ import annotations

import math
from pathlib import Path

from gpt2_platform.bench import processes
from gpt2_platform.bench.load import MODES, LevelResult


def _ms_pair(p50: float, p99: float, digits: int) -> str:
    if math.isnan(p50):
        return "-"
    return f"{p50:.{digits}f} / {p99:.{digits}f}"


def markdown_header(with_engine: bool) -> list[str]:
    engine = " engine tokens/s (HTTP / engine) |" if with_engine else ""
    return [
        f"| mode | concurrency | requests (failed) | requests/s | generated tokens/s |{engine} TTFT p50 / p99 ms "
        "| latency p50 / p99 ms | per token p50 / p99 ms | client CPU % |",
        "|---|---:|---:|---:|---:|" + ("---:|" if with_engine else "") + "---:|---:|---:|---:|",
    ]


def markdown_row(level: LevelResult, with_engine: bool) -> str:
    engine = ""
    if with_engine:
        engine = (
            f" {level.engine_tokens_per_s:.0f} ({level.http_to_engine_ratio:.2f}) |"
            if level.engine_tokens_per_s
            else " - |"
        )
    ttft = _ms_pair(level.ttft_p50_ms, level.ttft_p99_ms, 1) if level.mode == "stream" else "= latency"
    return (
        f"| {level.mode} | {level.concurrency} | {level.requests} ({_failed(level)}) | {level.requests_per_s:.2f} "
        f"| {level.generated_tokens_per_s:.0f} |{engine} {ttft} "
        f"| {_ms_pair(level.latency_p50_ms, level.latency_p99_ms, 1)} "
        f"| {_ms_pair(level.per_token_p50_ms, level.per_token_p99_ms, 2)} | {level.client_cpu_pct:.0f} |"
    )


def _failed(level: LevelResult) -> str:
    retried = level.retried_429
    return f"{level.failed}; {retried} 429s retried" if retried else str(level.failed)


def as_markdown(levels: list[LevelResult]) -> str:
    with_engine = any(level.engine_tokens_per_s for level in levels)
    lines = markdown_header(with_engine) + [markdown_row(level, with_engine) for level in levels]
    if any(level.mode == "nonstream" for level in levels):
        lines += ["", "nonstream: the first token arrives with the last, so TTFT is the whole request's latency."]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path | None:
    """Tokens/s and TTFT p99 against concurrency, per mode, with the engine alone as a reference;
    None when matplotlib is not installed (it is not a dependency of the project)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import FuncFormatter

    figure, (throughput, ttft) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for mode, marker in zip(MODES, ("o", "s"), strict=True):
        levels = sorted((lv for lv in report["levels"] if lv.get("mode", "stream") == mode), key=_concurrency)
        if not levels:
            continue
        x = [lv["concurrency"] for lv in levels]
        throughput.plot(x, [lv["generated_tokens_per_s"] for lv in levels], marker=marker, label=f"HTTP, {mode}")
        # Non-streaming: the first token comes with the last, so its TTFT is the request's latency.
        label = "TTFT p99, stream" if mode == "stream" else "latency p99 (= TTFT), nonstream"
        ttft.plot(x, [lv["ttft_p99_ms"] for lv in levels], marker=marker, label=label)
    engine_rows = sorted((report.get("engine_baseline") or {}).get("rows", []), key=lambda r: r["batch_size"])
    if engine_rows:
        throughput.plot(
            [r["batch_size"] for r in engine_rows],
            [r["tokens_per_s"] for r in engine_rows],
            linestyle="--",
            marker="x",
            color="black",
            label="engine alone (batch = concurrency)",
        )
    concurrency_levels = sorted({lv["concurrency"] for lv in report["levels"]})
    for axes in (throughput, ttft):
        axes.set_xscale("log", base=2)
        axes.set_xticks(concurrency_levels, [str(c) for c in concurrency_levels])
        axes.minorticks_off()
        axes.set_xlabel("concurrent requests")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    throughput.set_ylabel("generated tokens/s")
    throughput.set_title("throughput", fontsize=10)
    ttft.set_ylabel("ms (log scale)")
    ttft.set_yscale("log")  # from tens of ms at one request to seconds once requests queue
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ttft.yaxis.set_major_formatter(plain)
    ttft.yaxis.set_minor_formatter(plain)
    ttft.set_title("time to first token, p99", fontsize=10)
    config = report.get("config", {})
    figure.suptitle(
        f"{report.get('model', '?')}: {config.get('prompt_tokens', '?')} prompt + "
        f"{config.get('max_tokens', '?')} generated tokens per request"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def _concurrency(level: dict) -> int:
    return level["concurrency"]


def level_lines(level: LevelResult) -> list[str]:
    """What is printed as a level ends: its table row, the processes that used the CPU, and where the
    engine's time to a first token went (our app only)."""
    lines = [markdown_row(level, with_engine=False)]
    if level.process_cpu is not None:
        lines.append(f"  {processes.as_line(level.process_cpu)}")
    split = level.engine_split
    if split is not None:
        lines.append(
            f"  engine: {split['steps']} steps, {split['tokens_per_step']:.1f} tokens a step; a first token waited "
            f"{split['queue_ms']:.2f} ms for a slot and {split['admission_to_first_token_ms']:.2f} ms from "
            f"admission (means; the rest of the TTFT is HTTP, the ingress and the token link)"
        )
        gcs = {k: round(v, 2) for k, v in split.items() if "gc" in k}
        if gcs:
            lines.append(f"  full garbage collections: {gcs}")
    return lines


def engine_comparison_lines(levels: list[LevelResult]) -> list[str]:
    """HTTP tokens/s against the engine alone's, per level that has a baseline (none: no lines)."""
    rows = [lv for lv in levels if lv.engine_tokens_per_s]
    if not rows:
        return []
    lines = ["", "HTTP against the engine alone (same model and shapes, batch size = concurrency):"]
    for level in rows:
        lines.append(
            f"  {level.mode} concurrency {level.concurrency}: HTTP {level.generated_tokens_per_s:,.0f} tokens/s, "
            f"engine {level.engine_tokens_per_s:,.0f} tokens/s, HTTP / engine {level.http_to_engine_ratio:.2f}"
        )
    return lines
