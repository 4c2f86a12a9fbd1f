"""`ray job submit` of a tiny run to a cluster started with `ray start --head` (token auth on): jobs/train.py's happy
path, its exit status and what it prints, as a user submits it."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpt2_platform.checkpoint import WEIGHTS_NAME
from gpt2_platform.train.resume import TRAIN_STATE
from gpt2_platform.train.trainer import FINAL_MODEL_DIR
from ray_head import RayHead, finish

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
# The checkout less what .gitignore names (Ray reads no .git/info/exclude) is about 1.5 MB.
MAX_UPLOAD_BYTES = 5 * 2**20


# ray_head (conftest.py): a `ray start --head` of 2 CPUs with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2 in its
# environment (Ray Train's controller polls every 2 s by default, and each report waits for a poll), shared with
# tests/test_serve_proxy.py, which runs right after this module; it is stopped after that one, failing its last
# test if any of the head's processes outlived it.


def tail(text: str, num_lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-num_lines:])


def uploaded_size_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def submit(ray_head: RayHead, entrypoint: list[str]) -> subprocess.Popen:
    """`ray job submit` of `entrypoint` with the checkout as the working dir, started, not waited for."""
    return ray_head.start_ray(
        "job", "submit", "--address", ray_head.dashboard_url, "--working-dir", str(REPO_ROOT), "--", *entrypoint,
        cwd=REPO_ROOT,
    )  # fmt: skip


def training_actors_alive(ray_head: RayHead) -> list[str]:
    status, body = ray_head.get("/api/v0/actors?limit=1000", token=ray_head.token)
    assert status == 200, body
    alive = [a for a in json.loads(body)["data"]["result"]["result"] if a["state"] == "ALIVE"]
    return [a["class_name"] for a in alive if "Train" in a["class_name"]]


def test_submitted_tiny_run_succeeds_and_leaves_a_checkpoint(ray_head: RayHead, corpus: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    # Auth is on: no token is refused with 401, a wrong one with 403; the CLI needs RAY_AUTH_MODE=token.
    assert ray_head.get("/api/jobs/", token=None)[0] == 401
    assert ray_head.get("/api/jobs/", token="not-the-token")[0] == 403
    status, body = ray_head.get("/api/jobs/", token=ray_head.token)
    assert status == 200 and json.loads(body) == [], body

    storage = tmp_path / "runs"
    overrides = [
        f"data.paths=[{corpus}]",
        f"run.storage_path={storage}",
        "run.name=submitted",
        "scaling.num_workers=1",
        "train.max_steps=6",
        "train.checkpoint_every=3",
        "train.log_every=3",
        "train.eval_every=0",
        "data.block_size=32",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=1",
    ]
    entrypoint = ["python", "jobs/train.py", "--config", "jobs/configs/tiny.yaml"]
    for override in overrides:
        entrypoint += ["--set", override]
    # More workers than the 2-CPU head holds: refused in one line, no Ray Train retrying every 60 s.
    too_big = [*entrypoint, "--set", "run.name=too-big", "--set", "scaling.num_workers=8"]
    # The CLI calls and both jobs at once: each mostly waits (on Ray's polls, a process starting), and the
    # refusal counts the cluster's CPUs, not the ones the other job holds.
    without_mode = {key: value for key, value in ray_head.client_env().items() if key != "RAY_AUTH_MODE"}
    started = {
        "listed": ray_head.start_ray("job", "list", "--address", ray_head.dashboard_url),
        "refused_listing": ray_head.start_ray("job", "list", "--address", ray_head.dashboard_url, env=without_mode),
        "submitted": submit(ray_head, entrypoint),
        "too_big": submit(ray_head, too_big),
    }
    try:
        done = {name: finish(process, timeout_s=240) for name, process in started.items()}
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    listed, refused = done["listed"], done["refused_listing"]
    assert listed.returncode == 0, listed.stdout
    assert refused.returncode != 0 and "Missing authentication token" in refused.stdout, refused.stdout

    submitted = done["submitted"]
    assert submitted.returncode == 0, f"`ray job submit` failed:\n{tail(submitted.stdout)}"
    submission_id = re.search(r"raysubmit_\w+", submitted.stdout).group(0)
    assert f"Job '{submission_id}' succeeded" in submitted.stdout, tail(submitted.stdout)
    status, body = ray_head.get(f"/api/jobs/{submission_id}", token=ray_head.token)
    assert status == 200 and json.loads(body)["status"] == "SUCCEEDED", body

    # What reached the cluster: the checkout less what .gitignore names (.venv, runs/, data/demo/).
    runtime_resources = ray_head.session_dir / "runtime_resources"
    packages = [path for path in (runtime_resources / "working_dir_files").glob("_ray_pkg_*") if path.is_dir()]
    assert len(packages) == 1, packages
    uploaded = packages[0]
    assert (uploaded / "jobs" / "train.py").is_file()
    assert not [name for name in (".venv", ".git", "runs", "data/demo") if (uploaded / name).exists()]
    assert uploaded_size_bytes(uploaded) < MAX_UPLOAD_BYTES, sorted(path.name for path in uploaded.iterdir())
    # The driver's py_modules (runtime.package_runtime_env) was merged with the job's working_dir.
    assert list((runtime_resources / "py_modules_files").glob("_ray_pkg_*/gpt2_platform/__init__.py"))

    # What jobs/train.py prints at the end of a run (tests/test_train_cli.py has its refusals): no error line, the
    # final step, and the exported model's directory.
    printed = submitted.stdout.splitlines()
    assert not [line for line in printed if line.startswith("error: ")], tail(submitted.stdout)
    assert "final metrics: step=6" in submitted.stdout, tail(submitted.stdout)
    (model_line,) = [line for line in printed if line.startswith("model (Hugging Face format): ")]
    run_dir = storage / "submitted"
    assert Path(model_line.split(": ", 1)[1]).resolve() == (run_dir / FINAL_MODEL_DIR).resolve()
    assert (run_dir / FINAL_MODEL_DIR / "config.json").is_file()
    assert (run_dir / FINAL_MODEL_DIR / "model.safetensors").is_file()
    checkpoint = run_dir / "checkpoint_step_00000006"
    assert (checkpoint / WEIGHTS_NAME).is_file(), sorted(path.name for path in run_dir.iterdir())
    assert json.loads((checkpoint / TRAIN_STATE).read_text())["step"] == 6
    model = AutoModelForCausalLM.from_pretrained(run_dir / FINAL_MODEL_DIR)
    assert (model.config.n_layer, model.config.vocab_size) == (2, 257)

    refused = done["too_big"]
    assert refused.returncode != 0, f"returncode {refused.returncode}:\n{tail(refused.stdout)}"
    # The CLI prints the job's log, then the same log again in the status message.
    errors = {line for line in refused.stdout.splitlines() if line.startswith("error: ")}
    assert errors == {
        "error: scaling.num_workers=8 workers of {CPU: 1} do not fit the cluster: its 1 node(s) have 2 CPU, room for "
        "2 worker(s); lower scaling.num_workers or the resources per worker, or add nodes"
    }, tail(refused.stdout)
    assert "failed with exit code 2" in refused.stdout, tail(refused.stdout)
    assert "Traceback" not in refused.stdout, tail(refused.stdout)
    # No training actor left behind, by either job (the finished run's go within moments of its driver's exit).
    deadline = time.monotonic() + 30
    while (left := training_actors_alive(ray_head)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"training actors left behind: {left}"
    assert not (storage / "too-big").exists()
