"""jobs/cluster.py starts a head with token auth (a private token file) and every port on loopback, and stops only
that head; jobs/monitor.py reaches it with either form of RAY_ADDRESS."""

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

from gpt2_platform.ops import local_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "jobs" / "cluster.py"
MONITOR = REPO / "jobs" / "monitor.py"
TCP_LISTEN = "0A"
# 127.0.0.1 as /proc/net/tcp writes it, and as /proc/net/tcp6 writes an IPv4-mapped ::ffff:127.0.0.1.
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


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


def listening_sockets_of(pids: set[int]) -> set[tuple[str, int]]:
    """(hex local address, port) of every TCP socket that one of `pids` listens on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # gone, or not ours
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == TCP_LISTEN and fields[9] in inodes:
                found.add((address, int(hex_port, 16)))
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


def test_token_file_is_readable_by_its_owner_only(cluster: Cluster):
    # Ray's own `ray get-auth-token --generate` writes it 0644 (the umask's mode).
    token = cluster.root / "home" / ".ray" / "auth_token"
    assert oct(token.stat().st_mode & 0o777) == oct(0o600)
    assert oct(token.parent.stat().st_mode & 0o777) == oct(0o700)


def test_every_port_of_the_head_listens_on_loopback_only(cluster: Cluster):
    """The metrics port has no token auth; the GCS, raylet and agents need none from outside either."""
    sockets = listening_sockets_of(set(local_cluster.processes_marked(str(cluster.state_dir.resolve()))))
    # The GCS, dashboard, raylet, object manager and agents at least (more come up while the head settles).
    assert len(sockets) >= 5, sockets
    assert {address for address, _ in sockets} <= LOOPBACK, sorted(sockets)


def run_monitor(cluster: Cluster, ray_address: str, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "RAY_ADDRESS": ray_address, "RAY_AUTH_MODE": "token", **env}
    return subprocess.run(
        [sys.executable, str(MONITOR), "status"],
        env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["dashboard URL", "GCS address"])
def test_monitor_status_takes_either_form_of_ray_address(cluster: Cluster, form: str):
    """docs/operating.md exports RAY_ADDRESS=http://127.0.0.1:8265 for `ray job submit`; monitor.py then runs
    itself as a job. With the GCS's host:port it connects as a driver. Both sample the head's one node."""
    if form == "dashboard URL":
        done = run_monitor(cluster, cluster.state.dashboard_url)
    else:  # a driver outside a job joins a loopback-only head in Ray's single-machine mode, as start says
        done = run_monitor(cluster, cluster.state.gcs_address, **{local_cluster.LOOPBACK_ONLY_VAR: "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no NVIDIA GPU on node" in done.stdout, done.stdout[-3000:]
    submitted = "submitted `python jobs/monitor.py status`" in done.stderr
    assert submitted == (form == "dashboard URL"), done.stderr[-3000:]


def test_a_driver_without_single_machine_mode_is_told_what_to_set(cluster: Cluster):
    # Ray would swap 127.0.0.1 for this machine's address, where nothing listens, and retry for minutes.
    done = run_monitor(cluster, cluster.state.gcs_address)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"listens on 127.0.0.1 only; run this with {local_cluster.LOOPBACK_ONLY_VAR}=0" in done.stdout


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


def test_a_missing_token_is_made_private(tmp_path: Path):
    """That Ray takes the token made here, the head above shows (its start reads it with `ray get-auth-token`)."""
    env = {"HOME": str(tmp_path / "home")}
    path = local_cluster.ensure_private_token(env)
    assert path == tmp_path / "home" / ".ray" / "auth_token"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits in hex, as Ray makes them
    assert local_cluster.ensure_private_token(env) == path and path.read_text() == token  # kept


def test_a_world_readable_token_is_made_private_and_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "token"
    path.write_text("a" * 64)
    path.chmod(0o644)
    assert local_cluster.ensure_private_token({"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(path)}) == path
    assert oct(path.stat().st_mode & 0o777) == oct(0o600) and path.read_text() == "a" * 64
    assert "was readable by others (mode 644)" in caplog.text


def test_a_token_given_in_the_environment_needs_no_file(tmp_path: Path):
    assert local_cluster.ensure_private_token({"HOME": str(tmp_path), "RAY_AUTH_TOKEN": "x" * 64}) is None
    assert not (tmp_path / ".ray").exists()
