"""A quiet run: CPU workers never load Triton, the demo's relay drops only Ray's listed false alarm, and a
batch job prints no leak report, no traceback and no error line that docs/operating.md does not list."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT
from gpt2_platform import quiet

# Ray's C++ log lines at error level: "[2026-12-05 12:56:22,831 E 22045 22045] core_worker.cc:...".
RAY_ERROR_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,.]+ E \d+ \d+\]")

CPU_WORKER_PROBE = """
import sys
import torch
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer
from gpt2_platform.train import cross_entropy
from gpt2_platform.train.loss import LMLoss

assert cross_entropy.available()  # installed: the question is only whether it gets loaded
torch.manual_seed(0)
model = GPT2(preset("tiny"))
# The training loss path with the head padded, as a worker runs it (the optimizer is left out: torch.optim
# itself imports torch._dynamo, and through it Triton, on its first parameter group).
inputs, targets = torch.randint(0, 257, (2, 2, 17)).unbind(0)
_, loss = model(inputs, targets, loss_fn=LMLoss("logits", vocab_multiple=64))
loss.backward()
engine = Engine(model.eval(), byte_tokenizer(), EngineConfig(max_batch_size=2, max_seq_len=64, dtype="fp32")).start()
try:
    greedy = GenerationParams(max_tokens=4, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    (completion,) = engine.generate([[1, 2, 3]], greedy)
    assert len(completion.token_ids) == 4
finally:
    engine.shutdown()
print("triton loaded:", "triton" in sys.modules)
"""

# As on a Ray Train worker: torch loaded by the process's main thread, the loop (and its profiler) run in another.
PROFILER_IN_A_THREAD_PROBE = """
import sys, threading
from pathlib import Path
import torch
from gpt2_platform.train.loop import Profiler

def train():
    profiler = Profiler(True, [1, 2], Path(sys.argv[1]), 0, torch.device("cpu"))
    for step in (1, 2):
        profiler.before_step(step)
        torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()
        profiler.after_step(step)

thread = threading.Thread(target=train)
thread.start()
thread.join()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "platform"), **extra}
    # A real CPU worker has neither: conftest sets the interpreter for the kernel tests, and a run here must
    # start its own Ray rather than join the session's.
    env.pop("TRITON_INTERPRET", None)
    env.pop("RAY_ADDRESS", None)
    return env


def test_the_cpu_training_loss_and_the_cpu_engine_never_load_triton():
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-c", CPU_WORKER_PROBE], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "triton loaded: False" in done.stdout, done.stdout


def test_the_training_profiler_started_off_the_main_thread_writes_its_trace_without_kinetos_thread_notice(
    tmp_path: Path,
):
    done = subprocess.run(
        [sys.executable, "-c", PROFILER_IN_A_THREAD_PROBE, str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "External init callback" not in done.stderr, done.stderr
    assert len(list(tmp_path.glob("rank0*.pt.trace.json"))) == 1


def test_the_demos_relay_drops_rays_listed_false_alarm_and_passes_every_other_line(capfd):
    (false_alarm,) = quiet.RAY_FALSE_ALARMS
    lines = [
        b"a line before\n",
        b"[2026-12-05 12:56:22,831 E 22045 22045] core_worker.cc:2465: Actor with class name: 'MapWorker' and ID: "
        b"'31bb' " + false_alarm + b". If the arguments in the object store go out of scope ...\n",
        b"[2026-12-05 12:56:23,000 E 22045 22045] core_worker.cc:1: another error, which must show\n",
        b"a line after, without a newline at the end",
    ]
    child = f"import os, sys; [os.write(2, line) for line in {lines!r}]; print('stdout untouched'); sys.exit(3)"
    assert quiet.run_relaying_stderr([sys.executable, "-c", child]) == 3
    out, err = capfd.readouterr()
    assert out == "stdout untouched\n"
    assert err.encode() == lines[0] + lines[2] + lines[3]


def test_a_batch_job_prints_no_leak_report_traceback_or_unlisted_error_line(ascii_model_dir: Path, tmp_path: Path):
    """jobs/generate.py as a user runs it, starting its own Ray: its whole output, Ray's workers' included."""
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"alice has {i} apples." for i in range(8)]}), prompts)
    command = [
        sys.executable,
        str(REPO_ROOT / "jobs" / "generate.py"),
        "--input", str(prompts),
        "--output", str(tmp_path / "out"),
        "--model", str(ascii_model_dir),
        "--set", "generation.max_tokens=4",
        "--set", "engine.dtype=fp32",
        "--set", "output.progress_bars=false",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=_env(HOME=str(tmp_path)), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "8 rows (8 this run, 0 errors)" in done.stdout, output[-3000:]
    assert "nanobind: leaked" not in output
    assert "Traceback" not in output
    lines = output.splitlines()
    assert not [line for line in lines if line.startswith("E ")]
    unlisted = [
        line
        for line in lines
        if RAY_ERROR_LINE.search(line) and not any(text.decode() in line for text in quiet.RAY_FALSE_ALARMS)
    ]
    assert not unlisted, "\n".join(unlisted)
