"""Shared fixtures: an isolated HOME, one local Ray cluster per session, tiny runs on generated data."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray 2.60 writes ~/.ray/auth_token for a new cluster, and transformers caches
# under ~/.cache: keep both out of the real home. Set before Ray is imported.
_HOME = tempfile.mkdtemp(prefix="gpt2-platform-test-home-")
os.environ["HOME"] = _HOME
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's controller polls its workers every 2 s by default, and a worker's ray.train.report waits
# for the controller to take the previous report (a queue of one): every report after the first costs
# up to one poll, and so do noticing a failed worker and a finished run. Ray Train passes the variable
# from the driver to its controller and workers. Tests' runs report every few steps: poll faster.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Ray exports metrics to the node's Prometheus endpoint every 10 s by default: a test that waits for its
# metric line (prometheus_lines) waited up to that long. A gauge stays on the endpoint for two intervals
# after its process last exported it (a finished run's worker): 10 s, ample for a test that scrapes
# right after its run.
os.environ.setdefault("RAY_metrics_report_interval_ms", "5000")
# Without a GPU, the engine's Triton kernels run in Triton's interpreter (tests/test_kernels.py). Read
# when the kernels are defined, so before anything imports the engine.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpt2_platform import demo_data  # noqa: E402
from gpt2_platform.runtime import set_local_worker_env  # noqa: E402
from gpt2_platform.train import config as config_lib  # noqa: E402

# As init_ray does for an embedded cluster, for every Ray a test starts here (the session's, a test's own
# head): the package by PYTHONPATH, not a py_modules runtime env (a worker with one cannot be one Ray started
# ahead, so every actor waited seconds more), ahead of the venv's editable install, so workers run this
# checkout's code; and no preemption watcher per training run.
set_local_worker_env()

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One embedded local Ray for the whole session (started on first use, stopped at the end)."""
    import ray

    ray.init(num_cpus=4, object_store_memory=400 * 2**20, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's generated stories as a text file (about 0.3 MB)."""
    return demo_data.write_text(tmp_path_factory.mktemp("data") / "corpus.txt", num_stories=4000)


def tiny_config(corpus: Path, storage: Path, *overrides: str) -> config_lib.Config:
    """A run of the tiny preset on CPU that finishes in seconds."""
    base = [
        f"data.paths=[{corpus}]",
        "data.block_size=32",
        "train.micro_batch_size=8",
        "train.max_steps=20",
        "train.log_every=5",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.checkpoint_every=10",
        "train.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "scaling.num_workers=1",
        "train.max_failures=0",
        f"run.storage_path={storage}",
    ]
    return config_lib.load(None, [*base, *overrides])


def prometheus_lines(metric: str, tag: str = "", timeout_s: float = 40.0, at_least: float | None = None) -> list[str]:
    """Sample lines of `metric` whose labels include `tag` (e.g. 'run="x"') on this node's Ray
    metrics endpoint, waiting for them (export takes ~10 s); [] if none come. `at_least`: wait until the
    first line's value is that much (a counter's increments reach the endpoint over several exports), and
    return what is there at the deadline."""
    import time
    import urllib.request

    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        lines = [line for line in text.splitlines() if line.startswith(metric + "{") and tag in line]
        if lines and (at_least is None or float(lines[0].rsplit(" ", 1)[1]) >= at_least):
            return lines
        time.sleep(1)
    return lines
