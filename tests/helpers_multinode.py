"""Running a multi-node Ray on this machine (`ray.cluster_utils.Cluster`, as Ray's own tests build one) in a
driver subprocess, and checking that nothing it started survives.

The cluster has its own driver, so it runs in a subprocess (the session's `ray_cluster` holds this process's
driver); every process it starts carries a marker in its environment, which is how the test finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class DriverRun:
    returncode: int
    log: str
    survivors: list[str]
    """Marked processes (pid and command) still alive after the driver ended, and killed then."""

    def result(self) -> dict:
        """The JSON the driver printed on its `RESULT ` line."""
        line = next(line for line in self.log.splitlines() if line.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])


def marked_processes(marker_var: str) -> list[int]:
    """Pids of live processes whose environment holds `marker_var`=1 (every process a driver started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{marker_var}=1".encode() in environ.split(b"\0") and state != "Z":
            pids.append(int(proc.name))
    return pids


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "(gone)"


def run_driver(driver: str, args: list[str], marker_var: str, timeout_s: float) -> DriverRun:
    """Run `python -c driver *args`, marked with `marker_var`, and kill whatever it leaves behind."""
    # A Ray temp dir of its own: the head records its address in the temp dir, where a later bare
    # `ray.init()` or `ray start` on this machine would find it. Short, for Ray's socket paths.
    ray_tmpdir = tempfile.mkdtemp(prefix="ray-multinode-")
    env = dict(os.environ, **{marker_var: "1", "RAY_TMPDIR": ray_tmpdir})
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [sys.executable, "-c", driver, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log = process.communicate()[0] + f"\n(the driver was killed after {timeout_s:g} s)"
    finally:
        if process.poll() is None:  # interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # Ray's processes exit on their own once the cluster is shut down; on a loaded machine that takes a while.
        deadline = time.monotonic() + 30
        while marked_processes(marker_var) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [f"{pid} {_command(pid)}" for pid in marked_processes(marker_var)]
        for pid in marked_processes(marker_var):  # only processes this test started: they carry its marker
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    return DriverRun(process.returncode, log, survivors)
