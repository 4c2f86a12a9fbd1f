"""The profiler traces a run writes (`<run>/profile/*.pt.trace.json`), summarised without TensorBoard.

TensorBoard's profiler plugin (`torch-tb-profiler`) is deprecated and not installed, so
`tensorboard --logdir <run>/profile` shows nothing. The files are Chrome trace JSON: Perfetto
(https://ui.perfetto.dev, "Open trace file") and chrome://tracing open them as they are, and
`jobs/trace_summary.py` prints what they hold: per trace, the steps it covers, the operators with the
most time of their own (a parent's time less its children's, as torch's `key_averages` counts self
time), and the GPU kernels and copies with the most time.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

VIEWER = "https://ui.perfetto.dev (Open trace file) or chrome://tracing"
STEP_PREFIX = "train step "
"""The training loop's range around each profiled optimizer step (train/loop.py: Profiler)."""
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class OpTime:
    name: str
    category: str
    total_ms: float
    calls: int


def trace_files(directory: Path) -> list[Path]:
    """The traces in `directory` (plain or gzipped), oldest name first."""
    return sorted(p for p in directory.iterdir() if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")))


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _complete_events(trace: dict, categories: tuple[str, ...]) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in categories]


def self_times(trace: dict) -> list[OpTime]:
    """CPU operators by their own time: each one's duration less that of the operators it called."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in _complete_events(trace, ("cpu_op", "user_annotation")):
        if event["name"].startswith(STEP_PREFIX):
            continue  # a step's range: its time is all of its operators'
        by_thread[(event.get("pid"), event.get("tid"))].append(event)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent starts first, or with its child and longer
        stack: list[tuple[dict, float]] = []  # (event, its children's time so far)
        for event in events + [None]:
            while stack and (event is None or event["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children = stack.pop()
                totals[done["name"]] += done["dur"] - children
                calls[done["name"]] += 1
                if stack:
                    stack[-1] = (stack[-1][0], stack[-1][1] + done["dur"])
            if event is not None:
                stack.append((event, 0.0))
    return sorted(
        (OpTime(name, "cpu_op", totals[name] / 1e3, calls[name]) for name in totals), key=lambda o: -o.total_ms
    )


def gpu_times(trace: dict) -> list[OpTime]:
    """GPU kernels, copies and fills by their total time (they do not nest)."""
    totals: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for event in _complete_events(trace, _GPU_CATEGORIES):
        key = (event["name"], event["cat"])
        totals[key] += event["dur"]
        calls[key] += 1
    return sorted((OpTime(n, c, totals[(n, c)] / 1e3, calls[(n, c)]) for n, c in totals), key=lambda o: -o.total_ms)


def steps(trace: dict) -> list[int]:
    """The optimizer steps a trace covers (the training loop's `STEP_PREFIX` ranges)."""
    names = {e["name"] for e in _complete_events(trace, ("user_annotation", "cpu_op"))}
    return sorted(int(n[len(STEP_PREFIX) :]) for n in names if n.startswith(STEP_PREFIX))


def summary(directory: Path, top: int = 15) -> str:
    """A text summary of every trace in `directory`; raises FileNotFoundError if it holds none."""
    files = trace_files(directory) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no profiler traces (*.pt.trace.json) in {directory}; run training with train.profile=true "
            "(train.profile_steps=[first, last]) to write them there"
        )
    lines = []
    for path in files:
        trace = load(path)
        covered = steps(trace)
        lines.append(f"{path.name}: " + (f"steps {covered[0]}-{covered[-1]}" if covered else "no step ranges"))
        lines.append(f"  CPU operators by self time (top {top}):")
        lines += [f"    {o.total_ms:10.3f} ms  {o.calls:6d} calls  {o.name}" for o in self_times(trace)[:top]]
        gpu = gpu_times(trace)
        if gpu:
            lines.append(f"  GPU kernels and copies by time (top {top}):")
            lines += [f"    {o.total_ms:10.3f} ms  {o.calls:6d} calls  {o.name[:100]}" for o in gpu[:top]]
    lines.append(f"open a trace in {VIEWER}")
    return "\n".join(lines)
