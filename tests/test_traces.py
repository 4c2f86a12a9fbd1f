"""train/traces.py: the profiler's trace files read back, their self times as torch's own table counts them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from gpt2_platform.model import GPT2, preset
from gpt2_platform.train import traces

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
