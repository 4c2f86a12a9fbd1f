"""Does the cluster have room for the training workers? Asked before the TorchTrainer starts, and
bounded while it runs.

Ray Train waits for its workers' placement group and, on a cluster that can never hold them, retries
every minute with a traceback until it is killed. Here a run that cannot fit is refused with one line;
one that could fit once other work frees resources, or once an autoscaler adds nodes, waits for at most
`scaling.resource_timeout_s` and says so.

The same holds after a restart: when a node with a worker is lost, Ray Train restarts the worker group
from the last checkpoint and waits for room for it again, by default a minute at a time, forever. Its wait
is set to `scaling.resource_timeout_s` (`placement_timeout`), and a run whose workers cannot be placed in
that time fails with one line (`lost_room_error`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

from gpt2_platform.train.config import ScalingConfig

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0

# Ray Train's controller reads its wait for the workers' placement group, at every start and restart, from
# this variable, which the trainer passes from the driver's environment to the controller.
PLACEMENT_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# A placement group takes a moment even where there is room: scaling.resource_timeout_s=0 still waits this.
MIN_PLACEMENT_WAIT_S = 1.0


class ClusterResourcesError(ValueError):
    """The cluster cannot hold the configured workers; the message says what is missing and what to change."""


def worker_bundle(scaling: ScalingConfig) -> dict[str, float]:
    """What one worker reserves, as Ray Train's ScalingConfig computes it (use_gpu adds one GPU unless
    resources_per_worker names GPU itself). The Train controller itself asks for no CPU."""
    bundle = {"CPU": scaling.cpus_per_worker}
    if scaling.use_gpu:
        bundle["GPU"] = 1.0
    bundle.update(scaling.resources_per_worker)
    return {name: amount for name, amount in bundle.items() if amount > 0}


def workers_that_fit(bundle: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many workers the nodes hold: each worker must fit on one node."""
    return sum(
        min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items()) for node in nodes
    )


def _node_resources() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def _autoscaler_max_resources() -> dict[str, float] | None:
    """The largest the cluster may grow to, per resource, if an autoscaler publishes its config; None for
    a fixed cluster. No public API says whether a cluster autoscales; Ray Train asks this same private call."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # an internal API: if it moves, treat the cluster as fixed
        logger.debug("could not read the autoscaler's cluster config", exc_info=True)
        return None


def autoscaled_node_types(status: dict) -> set[str]:
    """The node types an autoscaler status report names that belong to a real autoscaler config. On a
    cluster without one, the monitor runs read-only and names each node's type after its id (node_<id>)."""
    report = status.get("autoscaler_report") or {}
    node_types = set(report.get("active_nodes") or {}) | set((report.get("node_type_mapping") or {}).values())
    return {node_type for node_type in node_types if not node_type.startswith("node_")}


def _v1_autoscaler_running() -> bool:
    """Whether Ray's v1 autoscaler (`ray up`, KubeRay) runs, from the status its monitor writes every few
    seconds; if that cannot be read, the cluster counts as fixed."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return bool(raw) and bool(autoscaled_node_types(json.loads(raw)))
    except Exception:  # an internal format: if it changes, treat the cluster as fixed
        logger.debug("could not read the autoscaler's status report", exc_info=True)
        return False


def _describe(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def _totals(nodes: list[dict[str, float]], names: list[str]) -> str:
    return ", ".join(f"{sum(node.get(name, 0.0) for node in nodes):g} {name}" for name in names)


def _never_fits(scaling: ScalingConfig, bundle: dict[str, float], nodes: list[dict[str, float]]) -> str:
    """Why the workers cannot fit these nodes, naming the setting to change."""
    for name in bundle:
        if not any(node.get(name, 0.0) >= bundle[name] for node in nodes):
            if name == "GPU" and scaling.use_gpu and not any(node.get("GPU") for node in nodes):
                return (
                    "scaling.use_gpu=true but no node of the cluster has a GPU; set scaling.use_gpu=false "
                    "(CPU workers with gloo) or run on a cluster with GPUs"
                )
            field = "scaling.cpus_per_worker" if name == "CPU" else "scaling.resources_per_worker"
            largest = max((node.get(name, 0.0) for node in nodes), default=0.0)
            if not largest:
                return (
                    f"{field} asks for {name!r}, a resource no node of the cluster has; "
                    f"remove it or start the nodes with it (ray start --resources)"
                )
            return (
                f"a training worker needs {_describe(bundle)} but no node of the cluster has {bundle[name]:g} {name} "
                f"(the largest has {largest:g}); lower {field} or add a node that has it"
            )
    fit = workers_that_fit(bundle, nodes)
    return (
        f"scaling.num_workers={scaling.num_workers} workers of {_describe(bundle)} do not fit the cluster: "
        f"its {len(nodes)} node(s) have {_totals(nodes, list(bundle))}, room for {fit} worker(s); "
        f"lower scaling.num_workers or the resources per worker, or add nodes"
    )


def _wait_until_free(scaling: ScalingConfig, bundle: dict[str, float], why: str) -> None:
    """Poll until the workers fit the cluster's free resources, or refuse after the timeout."""
    timeout_s = scaling.resource_timeout_s
    logger.warning(
        "%s; waiting up to %g s (scaling.resource_timeout_s) for room for %d worker(s) of %s",
        why,
        timeout_s,
        scaling.num_workers,
        _describe(bundle),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        # Free resources summed over nodes: close enough to decide whether to wait (each node's share is
        # what the placement group needs, and Ray Train waits for that itself).
        free = ray.available_resources()
        if workers_that_fit(bundle, [free]) >= scaling.num_workers:
            logger.info("the cluster has room for the training workers now")
            return
        if time.monotonic() >= deadline:
            nodes = _node_resources()
            raise ClusterResourcesError(
                f"after waiting {timeout_s:g} s the cluster still has no room for scaling.num_workers="
                f"{scaling.num_workers} workers of {_describe(bundle)}: free {_totals([free], list(bundle))} of "
                f"{_totals(nodes, list(bundle))}; stop what holds them (a Serve app, another job), lower "
                f"scaling.num_workers, or raise scaling.resource_timeout_s"
            )
        time.sleep(POLL_INTERVAL_S)


@contextmanager
def cluster_room(scaling: ScalingConfig) -> Iterator[None]:
    """Return (enter) once the cluster has room for the workers; refuse at once if it never can.

    With an autoscaler, the workers' resources are requested from it while inside (request_resources),
    so that it adds nodes for them before the trainer asks; the request is withdrawn on leaving.
    """
    bundle = worker_bundle(scaling)
    nodes = _node_resources()
    if workers_that_fit(bundle, nodes) >= scaling.num_workers:
        free = ray.available_resources()
        if workers_that_fit(bundle, [free]) < scaling.num_workers:
            why = f"other work holds part of the cluster (free now: {_totals([free], list(bundle))} of {_totals(nodes, list(bundle))})"
            _wait_until_free(scaling, bundle, why)
        yield
        return
    most = _autoscaler_max_resources()
    if not most and not _v1_autoscaler_running():
        raise ClusterResourcesError(_never_fits(scaling, bundle, nodes))
    # An autoscaler's limits, where it publishes them, are totals per resource, as Ray Train checks them.
    if most:
        short = [name for name, amount in bundle.items() if amount * scaling.num_workers > most.get(name, 0.0)]
        if short:
            raise ClusterResourcesError(
                f"scaling.num_workers={scaling.num_workers} workers of {_describe(bundle)} need more than the "
                f"autoscaler may add: at most {', '.join(f'{most.get(n, 0):g} {n}' for n in short)}; "
                f"lower scaling.num_workers or the resources per worker, or raise the cluster's max_workers"
            )
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[bundle] * scaling.num_workers)
    try:
        _wait_until_free(scaling, bundle, "the cluster is too small for the training workers now")
        yield
    finally:
        request_resources(bundles=[])


@contextmanager
def placement_timeout(scaling: ScalingConfig) -> Iterator[None]:
    """While inside, a TorchTrainer started here waits at most `scaling.resource_timeout_s` for room for its
    workers, at its first start and after each restart (it reads the driver's environment when it starts).

    Pair it with `FailureConfig(controller_failure_limit=0)`: Ray Train counts a wait that ran out as a
    controller failure and, by default, starts waiting again without end.
    """
    wait_s = max(scaling.resource_timeout_s, MIN_PLACEMENT_WAIT_S)
    before = os.environ.get(PLACEMENT_TIMEOUT_VAR)
    if before is not None and float(before) != wait_s:
        logger.warning("%s=%s is ignored: training waits scaling.resource_timeout_s=%g s for room for its workers",
                       PLACEMENT_TIMEOUT_VAR, before, scaling.resource_timeout_s)  # fmt: skip
    os.environ[PLACEMENT_TIMEOUT_VAR] = f"{wait_s:g}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PLACEMENT_TIMEOUT_VAR, None)
        else:
            os.environ[PLACEMENT_TIMEOUT_VAR] = before


def is_placement_timeout(error: BaseException) -> bool:
    """Whether a TorchTrainer failed because its workers could not be placed in time. By the class's name:
    it is internal to Ray Train, wrapped in the public ControllerError."""
    failure = getattr(error, "controller_failure", None)
    return type(failure).__name__ == "WorkerGroupStartupTimeoutError"


def lost_room_error(scaling: ScalingConfig, last_checkpoint: Path | None) -> ClusterResourcesError:
    """The one line for a run whose workers found no room within scaling.resource_timeout_s (a lost node
    that did not come back, or other work holding what a restart needs)."""
    bundle = worker_bundle(scaling)
    nodes = _node_resources()
    where = (
        f"It stopped at its last checkpoint, {last_checkpoint}: resubmit the same run.name to resume from it"
        if last_checkpoint is not None
        else "It stopped before its first checkpoint: resubmit it"
    )
    return ClusterResourcesError(
        f"the training workers found no room within scaling.resource_timeout_s={scaling.resource_timeout_s:g} s: "
        f"scaling.num_workers={scaling.num_workers} workers of {_describe(bundle)} need a place each, the "
        f"cluster's {len(nodes)} live node(s) hold {workers_that_fit(bundle, nodes)} at most (free now: "
        f"{_totals([ray.available_resources()], list(bundle))}); a node was lost and none came back, or other "
        f"work holds the rest. {where} once the cluster has room, or raise scaling.resource_timeout_s"
    )
