"""Connecting to Ray: the same call starts an embedded local cluster or joins a running one."""

from __future__ import annotations

import json
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


def _job_own_gcs_address() -> str | None:
    """Inside a `ray job submit` driver: the GCS of the cluster that runs the job, from the command line of the
    raylet that started the job's supervisor. None elsewhere, or when it cannot be read.

    Ray sets the driver's RAY_ADDRESS from the address file in the head's temp dir, which the last `ray start`
    on the machine wrote: beside another Ray started later with the same temp dir, that is the other Ray. The
    driver is the supervisor's child (through a shell), and the supervisor, a worker, knows its raylet's pid.
    """
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    if RAY_JOB_CONFIG_JSON_ENV_VAR not in os.environ:
        return None
    pid = os.getppid()
    for _ in range(3):  # the shell, then the supervisor
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            raylet = next((entry[15:].decode() for entry in environ if entry.startswith(b"RAY_RAYLET_PID=")), None)
            if raylet is not None:
                arguments = Path(f"/proc/{raylet}/cmdline").read_bytes().decode(errors="replace").split("\0")
                flag = "--gcs-address="
                return next((argument[len(flag) :] for argument in arguments if argument.startswith(flag)), None)
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone, not ours to read, or not Linux
            return None
    return None


def _job_env_vars(names: dict[str, str]) -> dict[str, str]:
    """`names` less the variables that the job's own runtime env sets: Ray refuses to merge a driver's
    runtime env that sets the same variable as the job's."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job_config = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    taken = (job_config.get("runtime_env") or {}).get("env_vars") or {}
    return {name: value for name, value in names.items() if name not in taken}


def _joined_cluster_args(address: str) -> tuple[str, dict]:
    """The address to join (inside a job: the job's own cluster) and the ray.init() arguments for it.

    The workers' environment names the same GCS: Ray's state API (Ray Train's placement-group cleaner calls
    it from a worker) otherwise looks for a cluster among the Rays running on the node, logs "Found multiple
    active Ray instances" on every call when there are several, and joins the last one started.
    """
    from ray._common.network_utils import parse_address

    own = _job_own_gcs_address()
    if own is not None and own != address:
        if address != "auto":
            logger.warning("RAY_ADDRESS=%s is another Ray than the one running this job; joining the job's own at %s",
                           address, own)  # fmt: skip
        address = own
    _check_loopback_driver(address)
    runtime_env = package_runtime_env()
    if parse_address(address) is not None:  # a GCS's host:port, not "auto" or a ray:// client address
        runtime_env["env_vars"] = _job_env_vars({"RAY_ADDRESS": address})
    return address, {"runtime_env": runtime_env}


def init_ray(address: str | None = None, num_cpus: int | None = None, preload: tuple[str, ...] = ()) -> None:
    """Connect to RAY_ADDRESS / `address` if set, else start a local Ray; no-op if connected. Logs which
    cluster it reached and whether it started or joined it.

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
    address = address or os.environ.get("RAY_ADDRESS") or None
    if is_dashboard_url(address):
        raise ValueError(
            f"RAY_ADDRESS={address} is the dashboard's URL, which `ray job submit` takes; to run this against "
            "that cluster, submit it as a job (`ray job submit --working-dir . -- python jobs/...`), or give the "
            "GCS address (host:6379) to connect from a cluster node"
        )
    kwargs: dict = {"log_to_driver": True}
    started = address in (None, "local")
    if started:
        # "local", not None: ray.init(None) joins the head that the last `ray start` recorded in /tmp/ray (even
        # one since killed), which an embedded run never means to do.
        address = "local"
        kwargs.update(_prepare_local_cluster())
        if preload:
            # Ray's option for this is a system config (the raylet passes it to each worker it starts);
            # tests/test_batch.py checks that an actor of a preloading cluster finds torch imported.
            kwargs["_system_config"] = {"preload_python_modules": list(preload)}
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    else:
        assert address is not None  # None starts a cluster
        address, joined_kwargs = _joined_cluster_args(address)
        kwargs.update(joined_kwargs)
    context = ray.init(address=address, **kwargs)
    _quiet_worker_progress_bars()
    dashboard = f"http://{context.dashboard_url}" if context.dashboard_url else "none"
    logger.info(
        "Ray %s: %s at %s (dashboard %s): %s",
        ray.__version__,
        "started a local cluster" if started else "joined the cluster",
        ray.get_runtime_context().gcs_address,
        dashboard,
        ray.cluster_resources(),
    )


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
