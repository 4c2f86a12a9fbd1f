"""jobs/bench_engine.py on CPU: the engine's generation and its decode steps (one at a time and pipelined),
with the bytes a step must read; and the step-traffic arithmetic the GB/s figures rest on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from gpt2_platform.bench.generation import step_bytes
from gpt2_platform.model import GPT2, preset

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_engine_only_run_times_generation_and_pipelined_steps(tmp_path: Path):
    out = tmp_path / "engine.json"
    command = [
        sys.executable, "jobs/bench_engine.py", "--preset", "tiny", "--batch-sizes", "1", "3",
        "--prompt-tokens", "16", "--new-tokens", "24", "--engine-only", "--runs", "1", "--json-out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["rows"]] == [1, 3]
    assert all(r["implementation"] == "gpt2-platform engine" and r["tokens_per_s"] > 0 for r in result["rows"])
    # Steps are timed at every batch size, and batch 1 besides: keys come back as strings from JSON.
    assert set(result["pipelined_decode_step_ms"]) == {"1", "3"}
    assert all(ms > 0 for ms in result["pipelined_decode_step_ms"].values())
    assert result["step_bytes"]["3"] > result["step_bytes"]["1"]
    assert "| 3 |" in done.stdout and "GB/s" in done.stdout


def test_step_bytes_counts_weights_once_and_each_rows_cache():
    model = GPT2(preset("tiny"))
    config = model.config
    weights = sum(p.numel() for p in model.parameters()) * 2
    per_token = config.n_layer * 2 * config.n_embd * 2
    assert step_bytes(model, 1, 0, torch.bfloat16) == weights
    assert step_bytes(model, 8, 100, torch.bfloat16) == weights + 8 * 100 * per_token
    assert step_bytes(model, 8, 100, torch.float32) == 2 * (weights + 8 * 100 * per_token)
