"""A local Ray head with token authentication, started, inspected and stopped by the project itself.

`start` runs `ray start --head --block` in a process group of its own, with RAY_AUTH_MODE=token (the token
file made 0600), the dashboard on 127.0.0.1 and, unless other machines are to join, every other port (the
metrics port too, which no token guards) on loopback; it waits until the jobs API accepts the token and the
job agent answers. Beside another Ray on the machine: its ports other than the GCS's and the dashboard's are
ones nothing holds, and its temp dir is its own (so the address file there, from which Ray tells a job's
driver which cluster to join, names this head, not the last Ray started on the machine).
`stop` signals that group and then ends every process that still carries the cluster's marker variable, so
it stops this head only, unlike `ray stop`, which stops every Ray on the machine. The state (pid, ports,
log) lives in `state_dir`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TypeGuard

from gpt2_platform.ray_auth import (  # noqa: F401  (part of this module's interface)
    LOOPBACK_ONLY_VAR,
    TOKEN_PATH_VAR,
    TOKEN_VAR,
    ensure_private_token,
    token_file,
)
from gpt2_platform.serve import haproxy

logger = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("~/.gpt2-platform/cluster")
STATE_FILE = "cluster.json"
LOG_FILE = "head.log"
# Every process the head starts inherits it; Ray workers rename themselves, so command lines are not enough.
MARKER_VAR = "GPT2_PLATFORM_CLUSTER"
# What `ray start --block` prints once everything has started and it waits for a signal.
BLOCKING_MESSAGE = "will now block forever"


@dataclass
class ClusterPorts:
    """The head's ports; None lets Ray choose (it picks free ones for all but gcs and dashboard)."""

    gcs: int = 6379
    dashboard: int = 8265
    client_server: int | None = None
    node_manager: int | None = None
    object_manager: int | None = None
    metrics_export: int | None = None
    dashboard_agent_listen: int | None = None
    dashboard_agent_grpc: int | None = None
    runtime_env_agent: int | None = None

    @classmethod
    def free(cls) -> ClusterPorts:
        """Every port one that nothing listens on now: a head beside any other Ray on this machine."""
        return cls(*free_ports(len(fields(cls))))

    def with_free_ports(self) -> ClusterPorts:
        """These ports, with one that nothing listens on now for each left to Ray: Ray's own choice for the
        dashboard agent is a fixed port (52365), which another Ray on the machine holds, and an agent that
        cannot bind it exits, leaving a head that takes no job."""
        unset = [field.name for field in fields(self) if getattr(self, field.name) is None]
        return replace(self, **dict(zip(unset, free_ports(len(unset)), strict=True)))

    def flags(self) -> list[str]:
        names = {"gcs": "port", "client_server": "ray-client-server-port"}
        flags = []
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                flag = names.get(field.name, field.name.replace("_", "-") + "-port")
                flags.append(f"--{flag}={value}")
        return flags


@dataclass
class ClusterState:
    """What `start` records for `status` and `stop`."""

    pid: int
    """The `ray start --block` process; also its process group."""
    dashboard_url: str
    gcs_address: str
    state_dir: str
    temp_dir: str | None
    home: str
    loopback_only: bool = True
    """Every port on 127.0.0.1 (no other machine can join), or Ray's usual binding on all interfaces."""
    agent_port: int | None = None
    """The dashboard agent's HTTP port, through which the head runs submitted jobs (None: not recorded)."""

    @property
    def log_path(self) -> Path:
        return Path(self.state_dir) / LOG_FILE


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that nothing is bound to right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def own_temp_dir(state_dir: Path, env: Mapping[str, str]) -> Path:
    """Ray's temp dir for the head of `state_dir`: one no other Ray uses, and short, because Ray's unix
    sockets live under it (at most 107 characters)."""
    base = Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp")
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]
    return base / f"ray-{os.getuid()}-{digest}"


def ray_cli() -> str:
    """The `ray` of this interpreter's environment (so the head runs the Ray this package pins)."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise FileNotFoundError(
            "no `ray` command beside this Python or on PATH; install the project (pip install -e .)"
        )
    return found


def cluster_env(state_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The head's environment: `base` with token auth on, this venv first on PATH, and the marker."""
    env = dict(os.environ if base is None else base)
    env.pop("RAY_ADDRESS", None)  # a head starts a cluster; it joins none
    env.update(
        RAY_AUTH_MODE="token",
        # A job's `python` is whatever the raylet's PATH finds: make it this environment's.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        # Skip the drain on SIGTERM: it waits for a GCS that the same group signal is stopping (30 s).
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        # Serve's proxy answers its own errors (queue full, a dead replica) in OpenAI's JSON: serve/proxy.py.
        RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH="gpt2_platform.serve.proxy:middlewares",
        **{MARKER_VAR: str(state_dir)},
    )
    # HTTP through HAProxy, as cluster.yaml and KubeRay start Ray (deployments/gpt2-cluster.yaml says why),
    # its own errors in OpenAI's JSON through the launcher; RAY_SERVE_ENABLE_HA_PROXY=0 keeps the Python proxy.
    if env.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1":
        env.update(haproxy.environment(env))
    return env


def auth_token(env: Mapping[str, str], generate: bool = True) -> str:
    """The token this environment's Ray uses (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), made
    private, or made when there is none with `generate`: `ray start --head` refuses to start without one."""
    if generate:
        ensure_private_token(env)
    command = [ray_cli(), "get-auth-token"]
    done = subprocess.run(command, env=dict(env), capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"`{' '.join(command[1:])}` failed: {done.stderr.strip()}")
    return done.stdout.strip()


def read_state(state_dir: Path) -> ClusterState | None:
    path = state_dir.expanduser() / STATE_FILE
    return ClusterState(**json.loads(path.read_text())) if path.exists() else None


def is_running(state: ClusterState | None) -> TypeGuard[ClusterState]:
    if state is None:
        return False
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's: a recycled pid
        return False
    return True


def get(url: str, token: str | None, timeout_s: float = 10) -> tuple[int, str]:
    """GET `url` as (status, body), with `token` as a bearer token unless None."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def start(
    state_dir: Path = DEFAULT_STATE_DIR,
    ports: ClusterPorts | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    temp_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120,
    loopback_only: bool = True,
) -> ClusterState:
    """Start a token-authenticated head whose dashboard listens on 127.0.0.1; return once its jobs API answers.

    With `loopback_only` every other port listens on 127.0.0.1 as well. Without it, Ray binds them on all
    interfaces so that other machines can join: the metrics port then answers anyone on the network.
    """
    state_dir = state_dir.expanduser().resolve()
    previous = read_state(state_dir)
    if is_running(previous):
        raise ValueError(f"a cluster from {state_dir} is already running (pid {previous.pid}); stop it first")
    state_dir.mkdir(parents=True, exist_ok=True)
    ports = (ports or ClusterPorts()).with_free_ports()
    head_env = cluster_env(state_dir, env)
    temp_dir = temp_dir or own_temp_dir(state_dir, head_env)
    if loopback_only:
        head_env[LOOPBACK_ONLY_VAR] = "0"
    token = auth_token(head_env)
    command = [ray_cli(), "start", "--head", "--block", "--disable-usage-stats", "--dashboard-host=127.0.0.1"]
    command += ports.flags() + ["--include-dashboard=true"]
    command += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
    command += [f"--num-gpus={num_gpus}"] if num_gpus is not None else []
    command += [f"--temp-dir={temp_dir}"]
    state = ClusterState(
        pid=0,
        dashboard_url=f"http://127.0.0.1:{ports.dashboard}",
        gcs_address=f"127.0.0.1:{ports.gcs}",
        state_dir=str(state_dir),
        temp_dir=str(temp_dir),
        home=head_env.get("HOME", str(Path.home())),
        loopback_only=loopback_only,
        agent_port=ports.dashboard_agent_listen,
    )
    with open(state.log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=head_env, cwd=state_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    state.pid = process.pid
    (state_dir / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    try:
        _wait_until_ready(state, process, token, timeout_s)
    except BaseException:
        stop(state_dir)
        raise
    logger.info("Ray head %s started, dashboard %s", state.pid, state.dashboard_url)
    return state


def _wait_until_ready(state: ClusterState, process: subprocess.Popen, token: str, timeout_s: float) -> None:
    """Until the jobs API answers, `ray start` blocks (until then it is in calls that delay its SIGTERM
    handler) and the job agent answers: the dashboard lists jobs without one, but runs none."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        output = state.log_path.read_text(errors="replace")
        if process.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {process.returncode}:\n{output[-4000:]}")
        try:
            status, body = get(state.dashboard_url + "/api/jobs/", token)
            last = f"HTTP {status}: {body[:200]}"
        except OSError as error:  # not listening yet
            status, last = None, repr(error)
        if status == 200 and BLOCKING_MESSAGE in output:  # by then session_latest is this head's session
            if failure := _agent_bind_failure(state):
                raise RuntimeError(failure)
            problem = job_agent_problem(state)
            if problem is None:
                return
            last = problem
        time.sleep(0.5)
    raise TimeoutError(f"the head is not ready within {timeout_s:.0f} s ({last}); see {state.log_path}")


def _agent_bind_failure(state: ClusterState) -> str | None:
    """What the head's dashboard agent logged when it could not bind its port (it then exits), or None."""
    log = Path(state.temp_dir or "") / "session_latest" / "logs" / "dashboard_agent.log"
    try:
        text = log.read_text(errors="replace")
    except OSError:  # not started yet
        return None
    if "address already in use" not in text:
        return None
    return (
        f"the head's job agent could not bind port {state.agent_port}: another process (another Ray?) took it "
        f"after it was chosen; start again (see {log})"
    )


def job_agent_problem(state: ClusterState) -> str | None:
    """Why the head of `state` cannot take a submitted job now (None: it can).

    `ray job submit` goes to the head node's dashboard agent, which may have died (a port held by another Ray)
    while the dashboard still lists jobs. Its port alone is not enough to know it: another Ray's agent may
    answer there; so the agent must be one of this head's processes, listening on that port.
    """
    if state.agent_port is None:
        return None  # recorded before the port was: nothing to check against
    agents = [
        command
        for command in processes_marked(state.state_dir).values()
        if "dashboard/agent.py" in command and f"--listen-port={state.agent_port}" in command
    ]
    if not agents:
        return f"its job agent (dashboard agent, port {state.agent_port}) is not running"
    try:
        status, body = get(f"http://127.0.0.1:{state.agent_port}/api/healthz", token=None, timeout_s=5)
    except OSError as error:
        return f"its job agent on port {state.agent_port} does not answer ({error})"
    return None if status == 200 else f"its job agent on port {state.agent_port} answers HTTP {status}: {body[:200]}"


def processes_marked(marker: str, variable: str = MARKER_VAR) -> dict[int, str]:
    """PID -> command line of every process whose environment carries `variable`=`marker`, or whose
    command line names `marker` (Ray's workers rename themselves, but keep their environment)."""
    tagged = f"{variable}={marker}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker.encode() in cmdline or tagged in environ.split(b"\0"):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def stop(state_dir: Path = DEFAULT_STATE_DIR, grace_s: float = 20) -> dict[int, str]:
    """Stop the head started from `state_dir` and all it started; return the processes that outlived
    `grace_s` and were killed. A no-op ({}) when none is recorded."""
    state_dir = state_dir.expanduser().resolve()
    state = read_state(state_dir)
    if state is None:
        return {}
    if is_running(state):
        signal_group(state.pid, signal.SIGTERM)
        if not _wait_for_exit(state.pid, grace_s):
            signal_group(state.pid, signal.SIGKILL)
            _wait_for_exit(state.pid, 10)
    left = reap_marked(str(state_dir), MARKER_VAR, grace_s)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    if left:
        logger.warning("killed %d Ray processes that outlived the head: %s", len(left), sorted(left))
    return left


def reap_marked(marker: str, variable: str, grace_s: float) -> dict[int, str]:
    """Wait up to `grace_s` for a stopped head's marked processes to exit, then kill those left; returns them.

    Ray's workers live in process groups of their own and exit once they lose their raylet.
    """
    deadline = time.monotonic() + grace_s
    while (left := processes_marked(marker, variable)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait for `pid` to exit (reaping it when it is our child); True once it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # not our child: poll for it instead
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.2)
    return False


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def status(state_dir: Path = DEFAULT_STATE_DIR) -> dict[str, object]:
    """Whether the head of `state_dir` runs, where, and the Ray version its dashboard reports (with the token)."""
    state = read_state(state_dir.expanduser().resolve())
    if not is_running(state):
        return {"running": False, "state_dir": str(state_dir)}
    env = cluster_env(Path(state.state_dir), {**os.environ, "HOME": state.home})
    report: dict[str, object] = {"running": True, **asdict(state)}
    try:
        code, body = get(state.dashboard_url + "/api/version", auth_token(env, generate=False))
        report["ray_version"] = json.loads(body).get("ray_version") if code == 200 else f"HTTP {code}"
    except (OSError, RuntimeError) as error:
        report["ray_version"] = f"dashboard not answering: {error}"
    report["job_agent"] = job_agent_problem(state) or "answering"
    return report


def train_submit_command(state: ClusterState, root: Path, corpus: Path, storage_path: Path) -> list[str]:
    """A `ray job submit` of the tiny recipe to this head that works as printed, from any directory.

    The job runs in a copy of `root` that leaves out what git ignores, the corpus under data/ too; the head runs
    on this machine, so the job reads `corpus` and writes its run under `storage_path` where they are.
    """
    return [
        "ray", "job", "submit", "--address", state.dashboard_url, "--working-dir", str(root.resolve()), "--",
        "python", "jobs/train.py", "--config", "jobs/configs/tiny.yaml",
        "--set", f"data.paths=[{corpus.resolve()}]",
        "--set", f"run.storage_path={storage_path.resolve()}",
    ]  # fmt: skip
