"""The optimization report on CPU: tiny preset, cheap variants only (compile is slow on CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO_ROOT
from gpt2_platform.bench import report

TINY_ARGS = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--warmup", "1"]
CHEAP = ["--only", "baseline", "ours fp32", "--skip-inference"]


def hand_made_rows() -> list[dict]:
    common = {"batch_size": 2, "seq_len": 32, "num_micro_batches": 1, "final_loss": 5.0, "first_step_s": 0.5}
    return [
        {**common, "variant": "hf fp32 eager (baseline)", "step_ms": 20.0, "tokens_per_s": 3200.0, "speedup": 1.0,
         "mfu": None, "peak_mem_gib": None},
        {**common, "variant": "ours bf16 <fast> & co", "step_ms": 5.0, "tokens_per_s": 12800.0, "speedup": 4.0,
         "mfu": 0.42, "peak_mem_gib": 3.25},
    ]  # fmt: skip


def cpu_env() -> dict:
    return {"device": "CPU (test)", "device_type": "cpu", "torch": "2.x", "transformers": "5.x", "date": "today",
            "command": "python jobs/benchmark.py"}  # fmt: skip


@pytest.fixture(scope="module")
def benchmark_job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("jobs_benchmark", REPO_ROOT / "jobs" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_to_markdown_marks_unmeasured_cells() -> None:
    text = report.to_markdown(hand_made_rows(), cpu_env(), profile_text="GPU idle fraction: n/a (no GPU)")
    assert "| variant | batch x seq x micro |" in text
    assert report.CPU_NOTE in text
    baseline_line = next(line for line in text.splitlines() if line.startswith("| hf fp32 eager"))
    assert "1.00x" in baseline_line and baseline_line.count("n/a") == 2
    fast_line = next(line for line in text.splitlines() if line.startswith("| ours bf16"))
    assert "4.00x" in fast_line and "42.0%" in fast_line and "3.25" in fast_line
    assert "## Profile" in text


def test_write_chart(tmp_path: Path) -> None:
    path = report.write_chart(hand_made_rows(), tmp_path)
    assert path.exists() and path.stat().st_size > 0
    if path.suffix == ".svg":
        text = path.read_text()
        assert "&lt;fast&gt; &amp; co" in text and "4.00x" in text


def test_rows_speedup_relative_to_first() -> None:
    rows = report.rows_from_measurements(
        [(report.Measurement("a", 2, 32, 10.0, 100.0, None, None, 1.0, 5.0), 1),
         (report.Measurement("b", 2, 32, 10.0, 250.0, None, None, 1.0, 5.0), 4)]
    )  # fmt: skip
    assert [r["speedup"] for r in rows] == [1.0, 2.5]
    assert rows[1]["num_micro_batches"] == 4


def test_select_rejects_unknown_variant() -> None:
    assert report.select(["accumulation"]) == [report.ACCUMULATION]
    with pytest.raises(ValueError, match="matches no variant"):
        report.select(["no such variant"])


def test_report_end_to_end(benchmark_job: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert benchmark_job.main([*TINY_ARGS, *CHEAP, "--out", str(out)]) == 0
    document = json.loads((out / "report.json").read_text())
    rows = document["rows"]
    assert [r["variant"] for r in rows] == ["hf fp32 eager (baseline)", "ours fp32"]
    assert rows[0]["speedup"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None and r["peak_mem_gib"] is None for r in rows)
    markdown = (out / "report.md").read_text()
    assert "| hf fp32 eager (baseline) |" in markdown and report.CPU_NOTE in markdown
    charts = [p for p in (out / "report.png", out / "report.svg") if p.exists()]
    assert charts and charts[0].stat().st_size > 0


def test_accumulation_counts_all_micro_batches(tmp_path: Path) -> None:
    # The accumulation path without compile: same code as the ladder's x4 row, cheap on CPU.
    step = report.LadderStep(report.Variant("ours fp32 + grad accumulation x2", "ours", "fp32"), 2)
    rows = report.build_rows([step], "tiny", 2, 32, num_steps=1, warmup_steps=0, device=report.torch.device("cpu"))
    assert rows[0]["num_micro_batches"] == 2 and rows[0]["speedup"] == 1.0


def test_profile_writes_trace_and_summary(
    benchmark_job: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiled"
    only = ["--only", "ours fp32", "--skip-inference", "--profile"]
    assert benchmark_job.main([*TINY_ARGS, *only, "--out", str(out)]) == 0
    assert [p for p in (out / "profile").rglob("*") if p.is_file() and p.stat().st_size > 0]
    printed = capsys.readouterr().out
    assert "top 10 ops by self CPU time" in printed and "GPU idle fraction: n/a (no GPU)" in printed
    markdown = (out / "report.md").read_text()
    assert "## Profile" in markdown and "aten::" in markdown and "GPU idle fraction: n/a (no GPU)" in markdown
    profile = json.loads((out / "report.json").read_text())["profile"]
    assert 0 < len(profile["top_ops"]) <= 10
