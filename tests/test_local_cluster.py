"""jobs/cluster.py starts a head with token auth and a loopback-only dashboard, and stops only that head."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpt2_platform import local_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "jobs" / "cluster.py"
TCP_LISTEN = "0A"


class Cluster:
    """A head started by jobs/cluster.py in a temp dir of its own, with an isolated HOME (so its own token)."""

    def __init__(self) -> None:
        # Short, because Ray's unix sockets live under the temp dir (at most 107 characters).
        self.root = Path(tempfile.mkdtemp(prefix="gpt2lc-", dir="/tmp"))
        (self.root / "home").mkdir()
        self.state_dir = self.root / "state"
        # The test session's own Ray settings (conftest's ray.init sets RAY_AUTH_MODE) stay out.
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
        self.env["HOME"] = str(self.root / "home")

    def cli(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--state-dir", str(self.state_dir), *args],
            env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip

    @property
    def state(self) -> local_cluster.ClusterState:
        state = local_cluster.read_state(self.state_dir)
        assert state is not None, f"no {local_cluster.STATE_FILE} in {self.state_dir}"
        return state

    @property
    def token(self) -> str:
        return (self.root / "home" / ".ray" / "auth_token").read_text().strip()

    def get(self, path: str, token: str | None) -> tuple[int, str]:
        return local_cluster.get(self.state.dashboard_url + path, token)


def listening_addresses(port: int) -> set[str]:
    """Hex local addresses (as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == TCP_LISTEN and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    started = cluster.cli("start", "--free-ports", "--num-cpus=1", f"--temp-dir={cluster.root / 'ray'}")
    try:
        assert started.returncode == 0, f"start failed:\n{started.stdout}\n{started.stderr}"
        assert "RAY_AUTH_MODE=token" in started.stdout and cluster.state.dashboard_url in started.stdout
        yield cluster
    finally:
        local_cluster.stop(cluster.state_dir)  # a no-op once test_stop_ends_every_process_of_the_head has run
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.mark.parametrize("path", ["/api/version", "/api/jobs/"])
def test_dashboard_and_jobs_api_refuse_requests_without_the_token(cluster: Cluster, path: str):
    assert cluster.get(path, token=None)[0] == 401
    assert cluster.get(path, token="not-the-token")[0] == 403
    status, body = cluster.get(path, token=cluster.token)
    assert status == 200, body
    if path == "/api/version":
        import ray

        assert json.loads(body)["ray_version"] == ray.__version__


def test_dashboard_listens_on_loopback_only(cluster: Cluster):
    port = int(cluster.state.dashboard_url.rsplit(":", 1)[1])
    # 0100007F is 127.0.0.1; all-zero addresses would be 0.0.0.0 or ::.
    assert listening_addresses(port) == {"0100007F"}


def test_status_reports_the_running_head_and_a_second_start_is_refused(cluster: Cluster):
    status = cluster.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["running"] and report["pid"] == cluster.state.pid and report["ray_version"] == "2.60.0"
    again = cluster.cli("start", "--free-ports")
    assert again.returncode == 2 and f"already running (pid {cluster.state.pid})" in again.stdout, again.stdout


def test_stop_ends_every_process_of_the_head(cluster: Cluster):
    marker = str(cluster.state_dir.resolve())
    assert local_cluster.processes_marked(marker), "the head's processes do not carry the marker"
    stopped = cluster.cli("stop", timeout_s=120)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped", stopped.stdout + stopped.stderr
    assert not local_cluster.processes_marked(marker)
    assert local_cluster.read_state(cluster.state_dir) is None
    assert cluster.cli("status").stdout.startswith("not running")
