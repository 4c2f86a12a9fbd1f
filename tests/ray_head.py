"""A real `ray start --head` in its own process group, for tests that go through a cluster's front door.

The test session may already run an embedded Ray (conftest.py), so the head gets its own free
ports, temp dir and HOME, and is stopped by signalling its process group: `ray stop` would stop
every Ray on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gpt2_platform.ops.local_cluster import free_ports, reap_marked, signal_group
from gpt2_platform.ray_auth import ensure_private_token

VENV_BIN = Path(sys.executable).parent
RAY_CLI = str(VENV_BIN / "ray")
# Set in the head's environment, so every process it starts inherits it. Ray workers rename
# themselves (`ray::_StatsActor`), so their command lines do not always name the temp dir.
MARKER_VAR = "GPT2_PLATFORM_TEST_RAY_HEAD"
NUM_PORTS = 9
# What `ray start --block` prints once it has started everything and waits for a signal.
BLOCKING_MESSAGE = "will now block forever"


@dataclass
class RayHead:
    """A running head node; `root` holds its HOME (with the auth token), Ray's temp dir and its output."""

    root: Path
    dashboard_port: int
    process: subprocess.Popen

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def temp_dir(self) -> Path:
        return self.root / "ray"

    @property
    def session_dir(self) -> Path:
        return self.temp_dir / "session_latest"

    @property
    def log_path(self) -> Path:
        return self.root / "head.log"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def token(self) -> str:
        return (self.home / ".ray" / "auth_token").read_text().strip()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client_env(self) -> dict[str, str]:
        """The environment of a user of this cluster: its HOME (so its token) and RAY_AUTH_MODE=token."""
        return _environment(self.root)

    def ray(
        self, *args: str, timeout_s: float = 60, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the `ray` CLI as a user of this cluster would; stdout and stderr together in `.stdout`."""
        return finish(self.start_ray(*args, env=env, cwd=cwd), timeout_s)

    def start_ray(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
        """`ray` as in `ray()`, started and not waited for (`finish` waits), so that several run at once."""
        return subprocess.Popen(
            [RAY_CLI, *args],
            env=self.client_env() if env is None else env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def get(self, path: str, token: str | None) -> tuple[int, str]:
        """GET a dashboard path as (status, body), sending `token` as a bearer token unless None."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(self.dashboard_url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the jobs API answers an authenticated request and `ray start` has finished starting."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited with {self.process.returncode}:\n{self.output()}")
            try:
                status, body = self.get("/api/jobs/", token=self.token)
                last = f"HTTP {status}: {body[:200]}"
            except OSError as error:  # not listening yet
                status, last = None, repr(error)
            # Until it blocks, `ray start` is still in calls that delay its SIGTERM handler (stop takes 15 s+).
            if status == 200 and BLOCKING_MESSAGE in self.output():
                return
            time.sleep(0.1)
        raise TimeoutError(f"the head's dashboard did not answer within {timeout_s:.0f} s ({last}):\n{self.output()}")

    def stop(self, grace_s: float = 15) -> dict[int, str]:
        """Stop the head and all it started; return the processes still alive after `grace_s` (now killed)."""
        marker = str(self.root)
        if self.process.poll() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        left = reap_marked(marker, MARKER_VAR, grace_s)
        shutil.rmtree(self.root, ignore_errors=True)
        return left


def finish(process: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Wait for a process of `RayHead.start_ray`; what it printed in `.stdout` (killed past `timeout_s`)."""
    try:
        stdout, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, None)


def _environment(root: Path) -> dict[str, str]:
    # Drop the test session's own Ray settings (conftest's ray.init sets RAY_AUTH_MODE, for one).
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(
        HOME=str(root / "home"),
        # A job's `python` is whatever the raylet's PATH finds: make it this venv's.
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        **{MARKER_VAR: str(root)},
    )
    return env


def start_head(
    num_cpus: int = 2, object_store_bytes: int = 200_000_000, timeout_s: float = 90, extra_env: dict | None = None
) -> RayHead:
    """Start `ray start --head --block` with token auth on, and wait until its jobs API answers.

    `extra_env`: more variables for the head's processes (the node's environment, as `export` before `ray start`)."""
    # Short, because Ray's unix sockets live under it (at most 107 characters).
    root = Path(tempfile.mkdtemp(prefix="rayhead-", dir="/tmp"))
    (root / "home").mkdir()
    env = {**_environment(root), **(extra_env or {})}
    # Skip the drain on SIGTERM: it waits for a GCS that the same group signal is stopping (30 s).
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # With RAY_AUTH_MODE=token, `ray start --head` refuses to start without a token; it makes none. Made here
    # as `ray get-auth-token --generate` makes one (256 random bits, hex, in $HOME/.ray/auth_token), without
    # the seconds a `ray` CLI process takes to start.
    ensure_private_token(env)
    gcs, dashboard, client_server, node_manager, object_manager, metrics, agent_http, agent_grpc, runtime_env_agent = (
        free_ports(NUM_PORTS)
    )
    command = [
        RAY_CLI, "start", "--head", "--block", "--disable-usage-stats",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client_server}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--metrics-export-port={metrics}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env_agent}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_bytes}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--temp-dir={root / 'ray'}",
    ]  # fmt: skip
    with open(root / "head.log", "wb") as log:
        process = subprocess.Popen(
            command, env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    head = RayHead(root=root, dashboard_port=dashboard, process=process)
    try:
        head.wait_until_ready(timeout_s)
    except BaseException:
        head.stop()
        raise
    return head
