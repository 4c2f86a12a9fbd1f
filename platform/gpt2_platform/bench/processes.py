"""Which processes on this machine spent the CPU during a benchmark level, grouped by role.

A serving benchmark's throughput is often set by a CPU-bound process (an ingress replica, the
proxy, the load generator itself) rather than by the GPU; snapshotting every process's CPU time
at a level's start and end shows which. A monitor must never take the benchmark down: processes
that vanish or cannot be read are counted and skipped, and without psutil the sampler reports
no data.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from gpt2_platform.engine.process import ENGINE_PROCESS_NAME

logger = logging.getLogger(__name__)

# Binaries whose own name is their role.
_NAMED_BINARIES = ("raylet", "gcs_server", "haproxy", "nginx", "envoy")


def _import_psutil():
    """psutil, or None. Ray ships its own copy in ray/thirdparty_files (it is not always installed
    on its own); that folder is found without importing Ray, which would cost a second."""
    try:
        import psutil

        return psutil
    except ImportError:
        pass
    spec = importlib.util.find_spec("ray")
    if spec is not None and spec.submodule_search_locations:
        vendored = Path(list(spec.submodule_search_locations)[0]) / "thirdparty_files"
        if (vendored / "psutil").is_dir():
            sys.path.append(str(vendored))
            try:
                import psutil

                return psutil
            except ImportError:
                pass
    return None


psutil = _import_psutil()


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    name: str
    cmdline: tuple[str, ...]
    cpu_s: float
    started_at: float
    """The process's create time: with the pid, a key that a reused pid does not match."""


@dataclass
class Snapshot:
    """Every readable process's CPU seconds (user + system) at one moment, keyed by (pid, start time)."""

    taken_at: float
    """time.monotonic() when the snapshot was taken."""
    cpu_s: dict[tuple[int, float], float] = field(default_factory=dict)
    roles: dict[tuple[int, float], str] = field(default_factory=dict)
    num_unreadable: int = 0
    """Processes that denied access or vanished while being read."""
    available: bool = True
    """False without psutil: no data at all."""


def role_of(name: str, cmdline: list[str] | tuple[str, ...], parent_role: str | None = None) -> str:
    """A short label for what a process is, so processes of the same role can be summed.

    Ray titles its workers `ray::<actor class>[.<method>]` (a Serve replica's class is
    `ServeReplica:<app>:<deployment>`); Python's multiprocessing gives a spawned child no title,
    only a cmdline with `multiprocessing.spawn`, so such a child is named from its parent.
    """
    joined = " ".join(cmdline)
    first = joined.split()[0] if joined.split() else ""
    if ENGINE_PROCESS_NAME in (name, first) or list(cmdline[-1:]) == [ENGINE_PROCESS_NAME]:  # engine/process.py's
        return "gpt2-engine"
    if first.startswith("ray::"):
        title = first[len("ray::") :].split(".")[0]
        if title.startswith("ServeReplica:"):
            return title.rsplit(":", 1)[-1]  # the deployment's name
        return title
    if "multiprocessing.resource_tracker" in joined:
        return "resource_tracker"
    if "compile_worker" in joined:
        return "torch compile worker"
    if "multiprocessing.spawn" in joined or "--multiprocessing-fork" in cmdline:
        if parent_role is not None and parent_role.startswith("ray:"):
            # A replica of an earlier version of this project (bench_serve.py --url measures any server)
            # spawned its engine with multiprocessing, and nothing else.
            return "gpt2-engine"
        return f"{parent_role or 'python'} child"
    if name in _NAMED_BINARIES:
        return name
    base = os.path.basename(first)
    if base.startswith("python") or name.startswith("python"):
        args = list(cmdline[1:])
        if "-m" in args and args.index("-m") + 1 < len(args):
            return args[args.index("-m") + 1]
        scripts = [a for a in args if a.endswith(".py")]
        if scripts:
            script = scripts[0]
            if "/ray/" in script:  # Ray's own daemons: dashboard/agent.py, _private/log_monitor.py, ...
                return "ray " + script.split("/ray/")[-1].removesuffix(".py")
            return os.path.basename(script).removesuffix(".py")
        return "python"
    return name or base or "?"


def _read_processes() -> tuple[list[_Process], int]:
    processes, num_unreadable = [], 0
    for process in psutil.process_iter():
        try:
            with process.oneshot():
                times = process.cpu_times()
                name, ppid, started_at = process.name(), process.ppid(), process.create_time()
                try:
                    cmdline = tuple(process.cmdline())
                except psutil.AccessDenied:  # its CPU time is still worth counting, named as it can be
                    cmdline = ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            num_unreadable += 1
            continue
        processes.append(_Process(process.pid, ppid, name, cmdline, times.user + times.system, started_at))
    return processes, num_unreadable


def _roles(processes: list[_Process], own_pid: int) -> dict[int, str]:
    by_pid = {p.pid: p for p in processes}
    roles: dict[int, str] = {}

    def resolve(pid: int, depth: int = 0) -> str:
        if pid in roles:
            return roles[pid]
        process = by_pid[pid]
        if pid == own_pid or (process.ppid == own_pid and "multiprocessing" in " ".join(process.cmdline)):
            role = "load generator"  # this process and the client processes it spawned
        elif process.ppid == 2 or pid == 2:
            role = "kernel threads"
        else:
            parent = None
            if process.ppid in by_pid and depth < 8:
                parent = resolve(process.ppid, depth + 1)
                parent_cmd = " ".join(by_pid[process.ppid].cmdline)
                if parent_cmd.startswith("ray::"):
                    parent = "ray:" + parent  # marks a Ray worker for role_of
            role = role_of(process.name, process.cmdline, parent)
        roles[pid] = role
        return role

    for process in processes:
        resolve(process.pid)
    return roles


def snapshot() -> Snapshot:
    """CPU seconds of every process on the machine now (no data without psutil)."""
    taken_at = time.monotonic()
    if psutil is None:
        return Snapshot(taken_at, available=False)
    processes, num_unreadable = _read_processes()
    roles = _roles(processes, os.getpid())
    result = Snapshot(taken_at, num_unreadable=num_unreadable)
    for process in processes:
        key = (process.pid, process.started_at)
        result.cpu_s[key] = process.cpu_s
        result.roles[key] = roles[process.pid]
    return result


def cpu_shares(before: Snapshot, after: Snapshot, top: int = 8) -> dict:
    """Each role's CPU between two snapshots, as % of one core over the time between them.

    A process that started in between counts from zero; one that ended in between is lost (its
    time cannot be read any more), so short-lived processes are undercounted.
    """
    wall_s = after.taken_at - before.taken_at
    if not (before.available and after.available) or wall_s <= 0:
        return {"available": False, "wall_s": wall_s, "top": []}
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for key, cpu_s in after.cpu_s.items():
        used = cpu_s - before.cpu_s.get(key, 0.0)
        role = after.roles[key]
        seconds[role] += max(0.0, used)
        if used > 0:
            counts[role] += 1
    ranked = sorted(seconds.items(), key=lambda item: item[1], reverse=True)
    rows = [
        {
            "name": role if counts[role] <= 1 else f"{role} x{counts[role]}",
            "role": role,
            "num_processes": counts[role],
            "cpu_s": round(used, 3),
            "cpu_pct": round(100.0 * used / wall_s, 1),
        }
        for role, used in ranked[:top]
        if used > 0
    ]
    return {
        "available": True,
        "wall_s": round(wall_s, 3),
        "num_cpus": psutil.cpu_count() if psutil is not None else None,
        "total_cpu_pct": round(100.0 * sum(seconds.values()) / wall_s, 1),
        "num_unreadable": max(before.num_unreadable, after.num_unreadable),
        "top": rows,
    }


def as_line(shares: dict) -> str:
    """One compact line: `CPU % of a core: GPT2Ingress x4 212, gpt2-engine 97, ... (all 410 of 1600)`."""
    if not shares.get("available"):
        return "process CPU: no data (psutil not importable)"
    parts = ", ".join(f"{row['name']} {row['cpu_pct']:.0f}" for row in shares["top"])
    num_cpus = shares.get("num_cpus")
    of = f" of {100 * num_cpus}" if num_cpus else ""
    return f"CPU % of a core: {parts} (all {shares['total_cpu_pct']:.0f}{of})"
