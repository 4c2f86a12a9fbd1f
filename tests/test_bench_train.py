"""jobs/bench_train.py on CPU: the hand-written anchor and our step timed in one process, and their
loss curves on real text."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_anchor_and_ours_are_timed_and_learn_the_same_text(corpus: Path, tmp_path: Path):
    out = tmp_path / "bench.json"
    command = [
        sys.executable, "jobs/bench_train.py", "--preset", "tiny", "--batch-size", "4", "--seq-len", "32",
        "--steps", "2", "--warmup", "1", "--only", "ours fp32", "anchor",
        "--curve-steps", "25", "--curve-text", str(corpus), "--json-out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    names = [r["variant"] for r in report["results"]]
    assert names == ["ours fp32", "plain GPT-2, nanoGPT-style (anchor)"]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]) for r in report["results"])
    for name, curve in report["curves"].items():
        assert len(curve) == 25 and all(math.isfinite(x) for x in curve), name
        # from about ln(257) at the start to well below it on the byte corpus
        assert sum(curve[-5:]) / 5 < curve[0] - 0.5, (name, curve)
    assert "| loss @ 25 |" in done.stdout and "anchor" in done.stdout
