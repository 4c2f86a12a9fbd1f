"""Are the run's paths the same on every node? Asked before a training run starts on a cluster of several nodes.

Rank 0 writes checkpoints from whatever node it lands on, a restarted run may resume on other nodes, and Ray
Data reads the data files on any node: `run.storage_path`, `data.paths` and a local `model.init_from` must name
the same files everywhere (docs/operating.md, "Storage on a multi-node cluster"). One small task per live node
checks it: the driver writes a marker file under run.storage_path, and each node looks for the marker and for
the files the run reads.

What it catches: a path that is missing on some node, and a path that exists on every node but is not one
filesystem (a local disk mounted at the same place on each: the marker is seen only where it was written). A
relative storage_path passes where it resolves to shared storage. What it cannot catch: storage that a node
loses later, or a node that joins after the check. A single-node cluster is not checked.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpt2_platform.train.config import Config
from gpt2_platform.train.data import find_files

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0
MARKER_PREFIX = ".gpt2-platform-shared-check-"
SHOWN_PER_SETTING = 3


class SharedPathError(ValueError):
    """A path of the run is not the same on every node; the message names the setting, the nodes and the fix."""


def missing_paths(paths: list[str]) -> list[str]:
    """Those of `paths` that this node does not see. Runs on each node."""
    return [path for path in paths if not os.path.exists(path)]


def write_marker(directory: Path) -> Path:
    """A new file in `directory`, for the nodes to look for. Its name is new, so no node has a cached answer for
    it (an NFS client may remember for a while that a name it looked up did not exist)."""
    marker = directory / f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    marker.write_text("written by the driver of a training run to check that every node sees this directory\n")
    return marker


def _deepest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _local_model_dir(init_from: str | None) -> str | None:
    """model.init_from when it is a directory here (not a hub name)."""
    if init_from is None:
        return None
    path = Path(os.path.expanduser(init_from))
    return str(path.resolve()) if path.is_dir() else None


def _node_name(node: dict) -> str:
    return f"{node['NodeManagerAddress']} (node {node['NodeID'][:8]})"


def check_shared_paths(config: Config, run_dir: Path) -> None:
    """Refuse the run, with one line, if a node of the cluster does not see its storage or its input files as
    this driver does. Seconds: one task per node. Nothing to do on a single-node cluster."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) < 2:
        return
    # The driver's own node sees what the driver sees; a task there could cost a worker process (a head
    # without CPUs has none started).
    here = ray.get_runtime_context().get_node_id()
    others = [node for node in nodes if node["NodeID"] != here]
    # Where run.storage_path does not exist yet, its deepest existing parent is what the nodes would create it in.
    marker = write_marker(_deepest_existing(run_dir.parent))
    reads = {
        "data.paths": [str(path.resolve()) for path in find_files(config.data.paths)],
        "model.init_from": [path] if (path := _local_model_dir(config.model.init_from)) else [],
    }
    try:
        check = ray.remote(missing_paths)
        tasks = [
            check.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote([str(marker), *reads["data.paths"], *reads["model.init_from"]])
            for node in others
        ]
        try:
            missing = dict(
                zip((_node_name(node) for node in others), ray.get(tasks, timeout=CHECK_TIMEOUT_S), strict=True)
            )
        except ray.exceptions.GetTimeoutError:
            for task in tasks:
                ray.cancel(task, force=True)
            logger.warning(
                "could not check within %g s that every node sees run.storage_path and data.paths; going on "
                "without (a node that does not will fail the run later)",
                CHECK_TIMEOUT_S,
            )
            return
    finally:
        marker.unlink(missing_ok=True)
    problems = []
    blind = sorted(name for name, paths in missing.items() if str(marker) in paths)
    if blind:
        problems.append(
            f"run.storage_path={config.run.storage_path} is not one filesystem on every node: {', '.join(blind)} "
            f"do not see the file {marker.name} that this driver wrote in {marker.parent}, so a checkpoint "
            f"written on one node would be missing on another after a restart"
        )
    for setting, paths in reads.items():
        not_seen = {name: [p for p in missing[name] if p in paths] for name in missing}
        not_seen = {name: found for name, found in not_seen.items() if found}
        if not_seen:
            first = sorted({p for found in not_seen.values() for p in found})
            shown = ", ".join(first[:SHOWN_PER_SETTING]) + (
                f" and {len(first) - SHOWN_PER_SETTING} more" if len(first) > SHOWN_PER_SETTING else ""
            )
            problems.append(f"{setting}: {', '.join(sorted(not_seen))} do not see {shown}")
    if problems:
        raise SharedPathError(
            "; ".join(problems) + ". On a cluster of several nodes, give paths on storage that every node "
            "mounts at the same place (NFS, EFS, a ReadWriteMany volume; docs/operating.md, 'Storage on a "
            "multi-node cluster')"
        )
    logger.info("every one of the %d nodes sees run.storage_path and the run's input files", len(nodes))
