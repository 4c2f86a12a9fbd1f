"""Beside another Ray on the machine, the local entry points reach the Ray they mean (issue 36).

The other Ray (the decoy) is the test session's own, and Ray's default temp dir is a fresh one whose address
file names it, as the last `ray start` on a shared machine leaves it. Ray's `serve run` and a job's driver
both join whatever that file names: jobs/serve.py (`make serve`) must start a Ray of its own instead, and
jobs/cluster.py's head must say running only once a job can be submitted, its jobs joining that head.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpt2_platform.ops import local_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MARKER_VAR = "GPT2_PLATFORM_TEST_TWO_RAYS"
STARTED = re.compile(r"started a local cluster at (\S+) ")
# What a job's driver prints once it is connected (a probe written by the test; see submit_probe).
PROBE = """
import json, logging, os
import ray
from gpt2_platform import runtime

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
runtime.init_ray()

@ray.remote
def worker_view():
    from ray.util.state import list_nodes  # with no address, as Ray Train's placement-group cleaner calls it
    return {"nodes": len(list_nodes()), "RAY_ADDRESS": os.environ.get("RAY_ADDRESS")}

print("PROBE", json.dumps({
    "gcs": ray.get_runtime_context().gcs_address,
    "own": runtime._job_own_gcs_address(),
    "worker": ray.get(worker_view.remote()),
}))
"""


class Machine:
    """A fresh default temp dir for Ray (RAY_TMPDIR) whose address file names the decoy, a HOME of its own,
    and a marker in the environment of every process started here, to find them all when stopping."""

    def __init__(self, decoy_address: str) -> None:
        # Short, because Ray's unix sockets live under its temp dir (at most 107 characters).
        self.root = Path(tempfile.mkdtemp(prefix="two-", dir="/tmp"))
        (self.root / "home").mkdir()
        self.address_file = self.root / "ray" / "ray_current_cluster"
        self.address_file.parent.mkdir()
        self.decoy_address = decoy_address
        self.address_file.write_text(decoy_address)
        # The test session's own Ray settings (conftest's ray.init sets RAY_AUTH_MODE) stay out.
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
        self.env.update(HOME=str(self.root / "home"), RAY_TMPDIR=str(self.root), **{MARKER_VAR: str(self.root)})

    def stop_everything(self) -> dict[int, str]:
        """Kill what is left of the processes started here (by pid, from the marker); return them."""
        return local_cluster.reap_marked(str(self.root), MARKER_VAR, grace_s=15)


@pytest.fixture
def machine(ray_cluster) -> Iterator[Machine]:
    import ray

    machine = Machine(ray.get_runtime_context().gcs_address)
    try:
        yield machine
    finally:
        left = machine.stop_everything()
        shutil.rmtree(machine.root, ignore_errors=True)
        assert not left, f"processes outlived the test and were killed: {left}"


def test_the_decoy_is_what_ray_would_join(machine: Machine, monkeypatch: pytest.MonkeyPatch):
    """What makes the tests below mean something: without an address, Ray picks the decoy from that file."""
    from ray._private.services import canonicalize_bootstrap_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(machine.root))
    assert canonicalize_bootstrap_address(None) == machine.decoy_address


def wait_for(pattern: re.Pattern, path: Path, process: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if match := pattern.search(text):
            return match
        assert process.poll() is None, f"exited with {process.returncode}:\n{text[-3000:]}"
        time.sleep(0.2)
    raise TimeoutError(f"no {pattern.pattern!r} within {timeout_s:.0f} s:\n{path.read_text()[-3000:]}")


def test_serve_starts_a_ray_of_its_own(machine: Machine):
    """`make serve` (jobs/serve.py) runs `serve run` in a Ray it starts, and says so with its address. Up to
    the first request it takes several times as long, so the test stops there."""
    config = yaml.safe_load((REPO / "deployments" / "gpt2.yaml").read_text())
    config["http_options"]["port"] = local_cluster.free_ports(1)[0]  # not 8000, which another Serve may hold
    config_path = machine.root / "gpt2.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = machine.root / "serve.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "jobs" / "serve.py"), str(config_path)],
            env=machine.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        address = wait_for(STARTED, log, process, timeout_s=90).group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert address != machine.decoy_address
    assert "joined" not in log.read_text()
    # Its session is in the temp dir it was given, not the decoy's.
    assert list((machine.root / "ray").glob("session_*"))


def test_serve_refuses_a_dashboard_url_in_one_line(machine: Machine):
    env = {**machine.env, "RAY_ADDRESS": "http://127.0.0.1:8265"}
    done = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "serve.py")],
        env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("error: ") and "serve deploy deployments/gpt2.yaml -a http://" in done.stdout
    assert done.stdout.count("\n") == 1 and "Traceback" not in done.stderr


def submit_probe(state: local_cluster.ClusterState, env: dict[str, str], directory: Path) -> str:
    """Run PROBE as a job on the head of `state`, as `ray job submit` does; its log."""
    directory.mkdir()
    (directory / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", state.dashboard_url,
         "--working-dir", str(directory), "--", "python", "probe.py"],
        env={**env, "RAY_AUTH_MODE": "token"}, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_cluster_start_beside_another_ray_takes_jobs_that_join_it(machine: Machine):
    state_dir = machine.root / "state"
    cluster = [sys.executable, str(REPO / "jobs" / "cluster.py"), "--state-dir", str(state_dir)]
    started = subprocess.run(
        [*cluster, "start", "--free-ports", "--num-cpus=1"],
        env=machine.env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "job agent answering" in started.stdout
        state = local_cluster.read_state(state_dir)
        # Its own temp dir, whose address file names it: there Ray looks up the address of a job's driver.
        assert Path(state.temp_dir).parent == machine.root and Path(state.temp_dir) != machine.root / "ray"
        assert (Path(state.temp_dir) / "ray_current_cluster").read_text() == state.gcs_address
        assert machine.address_file.read_text() == machine.decoy_address

        # The submit command it prints names the data and the run's folder by absolute paths (the upload
        # leaves out the git-ignored data/), and the checkout by its absolute path.
        line = next(line for line in started.stdout.splitlines() if line.startswith("  ray job submit "))
        command = shlex.split(line)
        assert command[command.index("--working-dir") + 1] == str(REPO)
        assert f"data.paths=[{REPO / 'data' / 'demo' / 'corpus.txt'}]" in command
        assert f"run.storage_path={REPO / 'runs'}" in command

        log = submit_probe(state, machine.env, machine.root / "probe")
        probe = json.loads(log.split("PROBE ", 1)[1].splitlines()[0])
        assert probe["gcs"] == probe["own"] == state.gcs_address, probe
        assert probe["worker"] == {"nodes": 1, "RAY_ADDRESS": state.gcs_address}, probe
        assert f"joined the cluster at {state.gcs_address}" in log
        assert "Found multiple active Ray instances" not in log and "another Ray than" not in log, log[-3000:]

        # The agent's check knows a port where none of this head's agents listens.
        bogus = local_cluster.ClusterState(**{**json.loads((state_dir / "cluster.json").read_text()), "agent_port": 1})
        assert "is not running" in local_cluster.job_agent_problem(bogus)
        assert local_cluster.job_agent_problem(state) is None
    finally:
        stopped = subprocess.run([*cluster, "stop"], env=machine.env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
