"""Profiler traces (a training run's `<run>/profile/*.pt.trace.json`, a batch job's engine windows), written and
summarised without TensorBoard.

TensorBoard's profiler plugin (`torch-tb-profiler`) is deprecated and not installed, so
`tensorboard --logdir <run>/profile` shows nothing. The files are Chrome trace JSON: Perfetto
(https://ui.perfetto.dev, "Open trace file") and chrome://tracing open them as they are, and
`jobs/trace_summary.py` prints what they hold: per trace, the steps it covers, the operators with the
most time of their own (a parent's time less its children's, as torch's `key_averages` counts self
time), the GPU kernels and copies with the most time, and how busy the device was: its gaps between
kernels by size, and how many of them began before the host had launched the work after them.
"""

from __future__ import annotations

import gzip
import itertools
import json
import time
from collections import Counter, defaultdict
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
    for op in _complete_events(trace, ("cpu_op", "user_annotation")):
        if op["name"].startswith(STEP_PREFIX):
            continue  # a step's range: its time is all of its operators'
        by_thread[(op.get("pid"), op.get("tid"))].append(op)
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


@dataclass(frozen=True)
class DeviceIdle:
    """Where a device waited in a trace, between its first and last kernel (or copy)."""

    span_ms: float
    busy_ms: float
    gaps: list[tuple[float, float, int, float, int]]
    """Per size class of gap, (from us, below us, gaps, idle ms, gaps whose next work the host launched late:
    after the gap had begun, so the host, not the device, held the device up)."""
    late_launches: dict[str, int]
    """The runtime calls that launched work late after a gap of 50 us or more, by count."""


GAP_CLASSES_US = ((0.0, 5.0), (5.0, 50.0), (50.0, 500.0), (500.0, float("inf")))


def device_idle(trace: dict) -> DeviceIdle | None:
    """The device's busy time and gaps in `trace`; None where it holds fewer than two kernels."""
    events = trace.get("traceEvents", [])
    work = sorted(_complete_events(trace, _GPU_CATEGORIES), key=lambda e: e["ts"])
    if len(work) < 2:
        return None
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    span = max(e["ts"] + e["dur"] for e in work) - work[0]["ts"]
    num_gaps: Counter[tuple[float, float]] = Counter()
    idle_us = dict.fromkeys(GAP_CLASSES_US, 0.0)
    num_launched_late: Counter[tuple[float, float]] = Counter()
    late: Counter[str] = Counter()
    busy_until = work[0]["ts"]
    for before, after in itertools.pairwise(work):
        # Copies may overlap kernels on another stream: the device is busy until the latest end so far.
        busy_until = max(busy_until, before["ts"] + before["dur"])
        gap = after["ts"] - busy_until
        if gap <= 0:
            continue
        size = next(s for s in GAP_CLASSES_US if s[0] <= gap < s[1])
        num_gaps[size] += 1
        idle_us[size] += gap
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] > busy_until:
            num_launched_late[size] += 1
            if gap >= 50:
                late[launch["name"]] += 1
    busy = span - sum(idle_us.values())
    return DeviceIdle(
        span / 1e3,
        busy / 1e3,
        [
            (low, high, num_gaps[low, high], idle_us[low, high] / 1e3, num_launched_late[low, high])
            for low, high in GAP_CLASSES_US
        ],
        dict(late.most_common(6)),
    )


def format_device_idle(idle: DeviceIdle) -> list[str]:
    lines = [
        f"device busy {idle.busy_ms / idle.span_ms:.0%} of {idle.span_ms:.1f} ms between the first and last kernel",
        "| gap between kernels us | gaps | idle ms | of the window | host launched after the gap began |",
        "|---|---:|---:|---:|---:|",
    ]
    for low, high, n, idle_ms, n_late in idle.gaps:
        lines.append(f"| {low:.0f}-{high:.0f} | {n} | {idle_ms:.2f} | {idle_ms / idle.span_ms:.1%} | {n_late} |")
    lines.append(f"calls that launched work late after a gap of 50 us or more: {idle.late_launches}")
    return lines


def record_window(path: Path, seconds: float) -> Path:
    """Profile the whole process (every thread's operators and CUDA calls, the device's kernels) for `seconds`
    from the calling thread, and write the Chrome trace to `path` whole (a partial file is never left under
    its name); returns `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, experimental_config=_all_threads_config()) as prof:
        time.sleep(seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    prof.export_chrome_trace(str(partial))
    partial.replace(path)
    return path


def _all_threads_config():
    """Kineto's options for a window recorded from a thread of its own: without `profile_all_threads` the trace
    holds only the calling thread's operators (the one that sleeps); with them also where the host waited for
    the device and Python's collections, where this torch has those options."""
    from torch._C._profiler import _ExperimentalConfig

    wanted = {"profile_all_threads": True, "enable_cuda_sync_events": True, "record_python_gc_info": True}
    while wanted:
        try:
            return _ExperimentalConfig(**wanted)
        except TypeError:  # an older torch: drop the newest option and try again
            wanted.popitem()
    return None


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
            "(train.profile_steps=[first, last]) to write them there, or a batch job with profile.trace_dir set"
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
        idle = device_idle(trace)
        if idle is not None:
            lines += [f"  {line}" for line in format_device_idle(idle)]
    lines.append(f"open a trace in {VIEWER}")
    return "\n".join(lines)
