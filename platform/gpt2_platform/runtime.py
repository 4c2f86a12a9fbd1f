"""Connecting to Ray: the same call starts an embedded local cluster or joins a running one."""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path

import ray

import gpt2_platform
from gpt2_platform.ray_address import is_dashboard_url
from gpt2_platform.ray_auth import LOOPBACK_ONLY_VAR, ensure_private_token

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(gpt2_platform.__file__).resolve().parent


def package_runtime_env() -> dict:
    """Ship this package to every worker, so jobs run the code the driver has.

    Inside `ray job submit --working-dir .` the workers' sys.path holds the
    working dir, not `platform/`; `py_modules` puts the package on it. Ray
    merges this with the job's own runtime env (working_dir, env_vars).
    """
    return {"py_modules": [str(PACKAGE_DIR)]}


def _free_port() -> int:
    """A port that nothing listens on now, from the kernel's ephemeral range: unlike Ray's 8265, which every
    other Ray on this machine asks for too, no other start-up is likely to take it before the dashboard binds
    it (Ray gives up on an explicit dashboard port that is taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _DropMessage(logging.Filter):
    """Drops one logger's records that start with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


# Ray warns on every new local cluster that it turned token auth on (which is what we want, and what the
# README says); it has no switch for that but RAY_AUTH_MODE, which must be set before Ray is imported.
_TOKEN_AUTH_NOTICE = _DropMessage("Token authentication is enabled for this Ray cluster")


def set_local_worker_env() -> None:
    """What the workers of a Ray started from this process (they inherit its environment) need, set in it.

    - The package by PYTHONPATH, first, not a py_modules runtime env: the workers run on this machine, from
      these files, and a worker with a runtime env waits for it to be unpacked and cannot be one of the
      workers Ray starts ahead: time before a batch actor's constructor runs (tools/probes/actor_startup.py
      measures it).
    - Ray Train's preemption watcher off: it waits for nodes to be drained, which a one-node cluster never
      is, and Ray logs an error-level line for every run that starts it.
    """
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    if str(PACKAGE_DIR.parent) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), *paths])


def _prepare_local_cluster() -> dict:
    """Environment and ray.init() arguments for a new embedded cluster; the environment reaches every worker
    (the local raylet inherits this process's).

    - Ray 2.60 turns token auth on for a new local cluster and would write the token world-readable: it is
      made 0600 first, so Ray finds it and writes none.
    - Ray's state API (which Ray Train's placement-group cleaner polls from a worker) finds its dashboard by
      looking for running GCS processes, and fails with a traceback when another Ray runs on this machine.
      Naming the dashboard (on a port chosen here) in RAY_API_SERVER_ADDRESS points it at this cluster.
    - The workers' environment: `set_local_worker_env`.
    """
    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "token":
        ensure_private_token(os.environ)
        notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
        if _TOKEN_AUTH_NOTICE not in notices.filters:
            notices.addFilter(_TOKEN_AUTH_NOTICE)
    set_local_worker_env()
    port = _free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return {"dashboard_host": "127.0.0.1", "dashboard_port": port}


def _check_loopback_driver(address: str) -> None:
    """ValueError if `address` is a GCS that listens on 127.0.0.1 only (`jobs/cluster.py start`) and this
    process is not in Ray's single-machine mode: Ray would swap 127.0.0.1 for this machine's address, which
    nothing listens on, and retry for minutes."""
    from ray._common.network_utils import is_localhost, parse_address

    parsed = parse_address(address)
    if parsed is None or not is_localhost(parsed[0]) or os.environ.get(LOOPBACK_ONLY_VAR) == "0":
        return
    port = int(parsed[1])
    for host, expected in (("127.0.0.1", True), (ray.util.get_node_ip_address(), False)):
        try:
            socket.create_connection((host, port), timeout=2).close()
            answered = True
        except OSError:
            answered = False
        if answered != expected:
            return
    raise ValueError(
        f"the Ray cluster at {address} listens on 127.0.0.1 only; run this with {LOOPBACK_ONLY_VAR}=0 in its "
        "environment (Ray's single-machine mode, as that cluster runs), or submit it with `ray job submit`"
    )


def _quiet_worker_progress_bars() -> None:
    """With stdout not a terminal (a job's log, a pipe), Ray Data's bars in workers come to the driver as tqdm
    redraws, cursor-movement escape codes included; without ray_tqdm they are logged as plain lines, as the
    driver's own are. A Dataset copies the DataContext when it is created, so this runs before any is."""
    if "ray.data" in sys.modules and not sys.stdout.isatty():
        sys.modules["ray.data"].DataContext.get_current().use_ray_tqdm = False


def init_ray(address: str | None = None, num_cpus: int | None = None, preload: tuple[str, ...] = ()) -> None:
    """Connect to RAY_ADDRESS / `address` if set, else start a local Ray; no-op if connected.

    `preload`: modules that a local Ray's worker processes import before they take work. Ray starts
    workers ahead of need, one per CPU, so an actor that needs torch finds a process that has it instead
    of importing it in its constructor, seconds on the path to a batch job's first rows
    (tools/probes/actor_startup.py). It costs each worker the modules' memory, and a worker started
    on demand for another task their import time, so only jobs whose actors all need them ask for it. A
    cluster already running keeps its own setting (docs/operating.md, "Batch generation").
    Nothing preloaded may touch CUDA: Ray sets a worker's CUDA_VISIBLE_DEVICES when it hands it a GPU
    actor, and a process that has initialised CUDA before then sees every GPU.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if is_dashboard_url(address):
        raise ValueError(
            f"RAY_ADDRESS={address} is the dashboard's URL, which `ray job submit` takes; to run this against "
            "that cluster, submit it as a job (`ray job submit --working-dir . -- python jobs/...`), or give the "
            "GCS address (host:6379) to connect from a cluster node"
        )
    kwargs: dict = {"log_to_driver": True}
    if address is None:
        # "local", not None: ray.init(None) joins a head that `ray start` recorded in /tmp/ray, which an
        # embedded run never means to do.
        address = "local"
        kwargs.update(_prepare_local_cluster())
        if preload:
            # Ray's option for this is a system config (the raylet passes it to each worker it starts);
            # tests/test_batch.py checks that an actor of a preloading cluster finds torch imported.
            kwargs["_system_config"] = {"preload_python_modules": list(preload)}
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    else:
        _check_loopback_driver(address)
        kwargs["runtime_env"] = package_runtime_env()
    ray.init(address=address, **kwargs)
    _quiet_worker_progress_bars()
    logger.info("Ray %s: %s", ray.__version__, ray.cluster_resources())


def run_as_job(
    dashboard_url: str, arguments: list[str], working_dir: Path, poll_s: float = 1.0, timeout_s: float = 600
) -> bool:
    """Run `python <arguments>` on the cluster behind `dashboard_url` as a Ray job with `working_dir` uploaded,
    as `ray job submit` would; print its log and return whether it succeeded. Under token auth, RAY_AUTH_MODE
    must be `token` (the client then sends ~/.ray/auth_token), as for the CLI."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    try:
        client = JobSubmissionClient(dashboard_url)
    except ConnectionError as error:
        raise ValueError(
            f"no Ray dashboard answers at {dashboard_url} ({error}); start the cluster or forward its dashboard "
            "(`ray dashboard cluster.yaml`), or fix RAY_ADDRESS"
        ) from error
    entrypoint = shlex.join(["python", *arguments])
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(working_dir)})
    logger.info("submitted `%s` to %s as job %s", entrypoint, dashboard_url, job_id)
    deadline = time.monotonic() + timeout_s
    while not (status := client.get_job_status(job_id)).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            raise TimeoutError(f"job {job_id} did not finish within {timeout_s:.0f} s; stopped it")
        time.sleep(poll_s)
    print(client.get_job_logs(job_id), end="", flush=True)
    if status != JobStatus.SUCCEEDED:
        logger.error("job %s ended %s", job_id, status.value)
    return status == JobStatus.SUCCEEDED
