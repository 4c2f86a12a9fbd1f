"""gpt2_platform/traces.py: the profiler's trace files read back, their self times as torch's own table counts them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from gpt2_platform import traces
from gpt2_platform.model import GPT2, preset

REPO = Path(__file__).resolve().parent.parent


def test_self_times_match_torchs_own_table_and_steps_are_found(tmp_path):
    model = GPT2(preset("tiny"))
    tokens = torch.randint(0, 257, (4, 33))
    with profile(
        activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(str(tmp_path), worker_name="rank0")
    ) as profiler:
        for step in (1, 2):
            with torch.profiler.record_function(f"{traces.STEP_PREFIX}{step}"):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
    (path,) = traces.trace_files(tmp_path)
    trace = traces.load(path)
    assert traces.steps(trace) == [1, 2]
    ours = {op.name: op for op in traces.self_times(trace)}
    theirs = {e.key: e for e in profiler.key_averages()}
    # The heaviest operators by torch's count: the same calls and self time (to rounding) from the file.
    heaviest = sorted((e for e in theirs.values() if e.key in ours), key=lambda e: -e.self_cpu_time_total)[:5]
    for event in heaviest:
        assert ours[event.key].calls == event.count, event.key
        assert ours[event.key].total_ms == pytest.approx(event.self_cpu_time_total / 1e3, rel=0.02, abs=0.01)


def test_the_summary_command_prints_tables_and_says_how_to_open_a_trace_or_why_there_is_none(tmp_path):
    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(str(tmp_path))):
        torch.nn.Linear(8, 8)(torch.randn(2, 8)).sum().backward()
    command = [sys.executable, str(REPO / "jobs" / "trace_summary.py"), str(tmp_path), "--top", "3"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "CPU operators by self time (top 3)" in done.stdout and "aten::" in done.stdout
    assert "ui.perfetto.dev" in done.stdout
    missing = subprocess.run([*command[:2], str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 2 and "train.profile=true" in missing.stderr


def _kernel(ts: float, dur: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": f"k{correlation}",
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def _launch(ts: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaGraphLaunch",
        "ts": ts,
        "dur": 2,
        "args": {"correlation": correlation},
    }


def test_device_idle_counts_gaps_by_size_and_the_ones_the_host_launched_late():
    trace = {
        "traceEvents": [
            _launch(0, 1),
            _kernel(10, 100, 1),  # busy 10-110
            _launch(20, 2),
            _kernel(112, 50, 2),  # a 2 us gap, launched well before it
            _launch(300, 3),
            _kernel(362, 38, 3),  # a 200 us gap (162-362), launched at 300: late
            {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 380, "dur": 40},  # overlaps the kernel
            _launch(410, 4),
            _kernel(1020, 80, 4),  # a 600 us gap (420-1020), launched at 410: not late
        ]
    }
    idle = traces.device_idle(trace)
    assert idle.span_ms == pytest.approx(1.090)
    assert idle.busy_ms == pytest.approx(1.090 - 0.802)
    by_class = {(low, high): (n, ms, late) for low, high, n, ms, late in idle.gaps}
    assert by_class[(0.0, 5.0)] == (1, pytest.approx(0.002), 0)
    assert by_class[(5.0, 50.0)] == (0, 0.0, 0)
    assert by_class[(50.0, 500.0)] == (1, pytest.approx(0.2), 1)
    assert by_class[(500.0, float("inf"))] == (1, pytest.approx(0.6), 0)
    assert idle.late_launches == {"cudaGraphLaunch": 1}
    assert "device busy 26%" in "\n".join(traces.format_device_idle(idle))
    assert traces.device_idle({"traceEvents": [_kernel(0, 1, 1)]}) is None


def test_a_recorded_window_holds_another_threads_operators_and_is_written_whole(tmp_path):
    import threading

    stop = threading.Event()

    def work():
        model = torch.nn.Linear(64, 64)
        while not stop.is_set():
            model(torch.randn(8, 64))

    worker = threading.Thread(target=work)
    worker.start()
    try:
        path = traces.record_window(tmp_path / "sub" / "engine.pt.trace.json", 0.2)
    finally:
        stop.set()
        worker.join()
    assert traces.trace_files(path.parent) == [path] and not list(path.parent.glob("*.partial"))
    names = {op.name for op in traces.self_times(traces.load(path))}
    assert "aten::linear" in names or "aten::addmm" in names
