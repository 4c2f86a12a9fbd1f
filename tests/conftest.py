"""Shared fixtures: an isolated HOME, one local Ray cluster per session, tiny runs on generated data."""

from __future__ import annotations

import os
import random
import socket
import tempfile
from collections.abc import Callable, Iterator
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

    # "local": without an address Ray joins the cluster that the last `ray start` on the machine recorded in
    # /tmp/ray (and refuses num_cpus for it, or waits on it when it is dead).
    ray.init(address="local", num_cpus=4, object_store_memory=400 * 2**20, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


# ---- resources that the tests of a few modules share -----------------------------------------------------
# A session fixture named here is stopped after the last test of the last module that uses it (directly or
# through another fixture), not at the end of the session: a Serve instance or a Ray head left running idles
# on the machine's CPUs through every module after its own. And the modules that use one run one after
# another (the two that share a `ray start --head` are not neighbours in file order).
_STOPPED_EARLY = ("serve_port", "ray_head")
_stop_after: dict[str, str] = {}  # fixture name -> node id of the test after whose teardown it stops
_stops: dict[str, Callable[[], None]] = {}  # fixture name -> how to stop what it started


def _stop_once(name: str, stop: Callable[[], None]) -> Callable[[], None]:
    def once() -> None:
        if _stops.pop(name, None) is not None:
            stop()

    _stops[name] = stop
    return once


def _uses(item: pytest.Item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for name in _STOPPED_EARLY:
        # The modules that use it, whole and in file order, where the first of their tests was. (In file order
        # whatever the command line's: test_job_submit.py needs the head's CPUs, which test_serve_proxy.py's
        # app holds until the head stops.)
        modules = sorted({item.path for item in items if _uses(item, name)})
        if len(modules) > 1:
            first = next(i for i, item in enumerate(items) if item.path in modules)
            group = [item for module in modules for item in items if item.path == module]
            rest = [item for item in items if item.path not in modules]
            items[:] = rest[:first] + group + rest[first:]


def pytest_collection_finish(session: pytest.Session) -> None:
    for name in _STOPPED_EARLY:
        users = [item for item in session.items if _uses(item, name)]
        if users:
            _stop_after[name] = [item for item in session.items if item.path == users[-1].path][-1].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # the module's own fixtures (the apps on a shared Serve, say) are torn down first
    for name in _STOPPED_EARLY:
        if _stop_after.get(name) == item.nodeid and name in _stops:
            _stops.pop(name)()
    return result


def free_port() -> int:
    # Below the OS's ephemeral range, where the ports Ray's own processes get are taken from.
    for _ in range(100):
        port = random.randint(20000, 30000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> Iterator[int]:
    """Ray Serve on the session's cluster, its HTTP proxy on this port; each module deploys and deletes its own
    apps (starting Serve costs seconds: its controller and proxy are processes of their own)."""
    from ray import serve
    from ray.serve._private import client

    # serve.run and serve.delete poll the controller every second until the app is up or gone: every
    # deploy and delete waited up to a second past it. (This process's client only; put back when Serve stops.)
    polling_interval_s, client.CLIENT_POLLING_INTERVAL_S = client.CLIENT_POLLING_INTERVAL_S, 0.1
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    def stop() -> None:
        serve.shutdown()
        client.CLIENT_POLLING_INTERVAL_S = polling_interval_s

    stop = _stop_once("serve_port", stop)
    yield port
    stop()


# The environment of the shared `ray start --head` (ray_head.py): each variable is for the tests of one module.
HEAD_ENV = {
    # Ray Train's controller polls every 2 s by default, and each report waits for a poll (see above):
    # for the runs submitted as jobs (test_job_submit.py).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    # As an operator exports them before `ray start` (test_serve_proxy.py): the proxy reads the first when it
    # starts, and the replicas (and the app builder) read the key from the node's environment.
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gpt2_platform.serve.proxy:middlewares",
    "GPT2_PROXY_TEST_KEY": "key-1",
}


@pytest.fixture(scope="session")
def ray_head():
    """A real `ray start --head` with token auth (2 CPUs), for the tests that go through a cluster's front door.
    Stopped after the last of them, failing that test if any of its processes outlived it."""
    from ray_head import start_head

    head = start_head(num_cpus=2, object_store_bytes=200_000_000, extra_env=HEAD_ENV)

    def stop() -> None:
        survivors = head.stop()
        assert not survivors, f"processes of the test's Ray head outlived it and were killed: {survivors}"

    stop = _stop_once("ray_head", stop)
    yield head
    stop()


@pytest.fixture(scope="session")
def ascii_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 trained for a few seconds on the demo stories (so it writes ASCII), with its tokenizer:
    what the Serve tests and the engine-process tests serve."""
    import torch

    from gpt2_platform import checkpoint
    from gpt2_platform.model import GPT2, preset
    from gpt2_platform.tokenizer import byte_tokenizer
    from gpt2_platform.train.config import OptimConfig
    from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    device = torch.device("cpu")
    optimizer = build_optimizer(model, OptimConfig(lr=5e-3), device)
    step = TrainStep(model, optimizer, resolve_precision("fp32", device), device, 1.0)
    text = " ".join(demo_data.stories(400)).encode()
    tokens = torch.tensor(list(text[: 64 * 65 * 4]), dtype=torch.long).view(-1, 65)
    for i in range(60):
        batch = tokens[(i * 16) % len(tokens) :][:16]
        step([(batch[:, :-1], batch[:, 1:])], lr=5e-3)
    directory = tmp_path_factory.mktemp("serve") / "model"
    return checkpoint.save_pretrained(model.eval(), directory, extra=lambda d: byte_tokenizer().save_pretrained(d))


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


# The run that tests/test_train_resume.py resumes (from copies) and tests/test_evaluate.py evaluates: 8 steps
# on one worker, a report every step, checkpoints at steps 2, 4, 6 and 8 (all kept), and a validation loss at
# steps 4 and 8 over eval_batches=3 micro-batches of a 2% validation split.
TINY_RUN_NAME = "resume"
TINY_RUN_OVERRIDES = (
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=4",
    "train.eval_every=4",
    "train.eval_batches=3",
    "data.val_fraction=0.02",
    f"run.name={TINY_RUN_NAME}",
)


@pytest.fixture(scope="session")
def tiny_run(ray_cluster, corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """The TrainResult of that run (its tests only read it, or copy it before they damage it)."""
    from gpt2_platform.train.trainer import fit

    storage = tmp_path_factory.mktemp("tiny-run")
    return fit(tiny_config(corpus, storage, *TINY_RUN_OVERRIDES, "train.max_steps=8"))


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
        time.sleep(0.25)
    return lines
