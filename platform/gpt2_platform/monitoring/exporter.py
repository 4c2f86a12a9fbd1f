"""Export GPU samples as Ray metrics: one `GpuExporter` actor per node, pinned there, and an `ExporterKeeper`
that gives one to each node that joins later.

The gauges land in Ray's Prometheus endpoint and so in the Ray dashboard's
Grafana panels, tagged with the node's address (`node`) and its Ray node id
(`node_id`, which tells apart Ray nodes on one host). A node without NVIDIA
GPUs runs the actor too; it reports `available=False` and exports nothing.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpt2_platform.monitoring.nvml import NodeSample, NvmlSampler

logger = logging.getLogger(__name__)

NAMESPACE = "gpt2-monitoring"
ACTOR_NAME_PREFIX = "gpt2-gpu-exporter-"
KEEPER_NAME = "gpt2-exporter-keeper"
# Prometheus (and so Ray) silently drops a metric whose name is outside this.
_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

GPU_TAG_KEYS = ("node", "node_id", "gpu", "uuid")
PROCESS_TAG_KEYS = (*GPU_TAG_KEYS, "pid", "ray_actor")


def validate_metric_name(name: str) -> str:
    """`name` if Prometheus accepts it, else ValueError (Ray would drop the metric without a word)."""
    if not _METRIC_NAME_RE.fullmatch(name):
        raise ValueError(f"metric name {name!r} is not valid for Prometheus ([a-zA-Z_:][a-zA-Z0-9_:]*)")
    return name


# metric name -> (description, GpuSample field); every name checked here, at definition.
GPU_METRICS: dict[str, tuple[str, str]] = {
    validate_metric_name(name): spec
    for name, spec in {
        "gpt2_gpu_utilization_percent": ("GPU busy time over the last sample period, %", "utilization_gpu_percent"),
        "gpt2_gpu_memory_utilization_percent": ("GPU memory busy time, %", "utilization_memory_percent"),
        "gpt2_gpu_memory_used_bytes": ("GPU memory in use, bytes", "memory_used_bytes"),
        "gpt2_gpu_memory_total_bytes": ("GPU memory in total, bytes", "memory_total_bytes"),
        "gpt2_gpu_power_watts": ("GPU power draw, W", "power_watts"),
        "gpt2_gpu_temperature_celsius": ("GPU temperature, C", "temperature_celsius"),
        "gpt2_gpu_sm_clock_mhz": ("GPU SM clock, MHz", "sm_clock_mhz"),
    }.items()
}
PROCESS_MEMORY_METRIC = validate_metric_name("gpt2_gpu_process_memory_bytes")
METRIC_NAMES: tuple[str, ...] = (*GPU_METRICS, PROCESS_MEMORY_METRIC)


def metric_points(sample: NodeSample) -> list[tuple[str, float, dict[str, str]]]:
    """(metric name, value, tags) for every known value in `sample`; fields that are None are left out.

    A process's `ray_actor` tag is its label in the sample (RayActorLookup.label fills it in).
    """
    points: list[tuple[str, float, dict[str, str]]] = []
    if not sample.available:
        return points
    for gpu in sample.gpus:
        tags = {"node": sample.node, "node_id": sample.node_id, "gpu": str(gpu.index), "uuid": gpu.uuid or ""}
        for name, (_, field_name) in GPU_METRICS.items():
            value = getattr(gpu, field_name)
            if value is not None:
                points.append((name, float(value), tags))
        for process in gpu.processes or []:
            if process.used_memory_bytes is not None:
                process_tags = {**tags, "pid": str(process.pid), "ray_actor": process.ray_actor}
                points.append((PROCESS_MEMORY_METRIC, float(process.used_memory_bytes), process_tags))
    return points


class RayActorLookup:
    """pid -> "Class:name-or-id" of the Ray actor in that process; "" when there is none or it is unknown.

    When Ray cannot be asked, lookups pause for `retry_s`. A pid with no
    actor yet (a process that has just started one) is asked about again after `miss_retry_s`.
    """

    def __init__(self, retry_s: float = 60.0, timeout_s: int = 2, miss_retry_s: float = 5.0) -> None:
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.miss_retry_s = miss_retry_s
        self._cache: dict[int, str] = {}
        self._missed_at: dict[int, float] = {}
        self._paused_until = 0.0

    def __call__(self, pid: int) -> str:
        if pid in self._cache:
            return self._cache[pid]
        now = time.monotonic()
        if now < self._paused_until or now - self._missed_at.get(pid, -math.inf) < self.miss_retry_s:
            return ""
        try:
            actors = self._alive_actors_in(pid)
        except Exception as error:
            logger.debug("actor lookup for pid %s failed: %r", pid, error)
            self._paused_until = time.monotonic() + self.retry_s
            return ""
        if not actors:
            self._missed_at[pid] = time.monotonic()
            return ""
        class_name, name, actor_id = actors[0]
        short_class = class_name.rsplit(".", 1)[-1]  # the GCS qualifies a class defined in a function
        label = self._cache[pid] = f"{short_class}:{name or actor_id[:12]}"
        self._missed_at.pop(pid, None)
        return label

    def _alive_actors_in(self, pid: int) -> list[tuple[str, str, str]]:
        """(class name, name, id) of the alive actors in process `pid`.

        Ray's state API is the public way, but it goes through the dashboard, which a cluster may run
        without (`--include-dashboard=false`); then the GCS's own actor table answers instead. It is given
        this cluster's GCS: without an address it looks for running GCS processes, and refuses to choose
        when another Ray runs on the same machine.
        """
        from ray.util.state import list_actors
        from ray.util.state.exception import ServerUnavailable

        try:
            actors = list_actors(
                address=ray.get_runtime_context().gcs_address,
                filters=[("pid", "=", pid), ("state", "=", "ALIVE")],
                timeout=self.timeout_s,
                raise_on_missing_output=False,
            )
            return [(a.class_name, a.name, a.actor_id) for a in actors]
        except ServerUnavailable:
            from ray._private import state as gcs_state

            table = gcs_state.actors().values()
            return [
                (a["ActorClassName"], a["Name"], a["ActorID"])
                for a in table
                if a.get("Pid") == pid and a.get("State") == "ALIVE"
            ]

    def label(self, sample: NodeSample) -> NodeSample:
        """Fill in each GPU process's `ray_actor`."""
        for gpu in sample.gpus:
            for process in gpu.processes or []:
                process.ray_actor = self(process.pid)
        return sample

    def forget_except(self, live_pids: set[int]) -> None:
        # pids are reused: keep only those still on a GPU.
        self._cache = {pid: label for pid, label in self._cache.items() if pid in live_pids}
        self._missed_at = {pid: at for pid, at in self._missed_at.items() if pid in live_pids}


@ray.remote(num_cpus=0, max_restarts=-1)
class GpuExporter:
    """Samples this node's GPUs every `interval_s` and sets the gauges; never raises out of its loop."""

    def __init__(self, interval_s: float = 5.0, node: str | None = None) -> None:
        from ray.util.metrics import Gauge

        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.sampler = NvmlSampler(
            node=node or ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id()
        )
        self.actor_of_pid = RayActorLookup()
        self.gauges = {
            name: Gauge(name, description, tag_keys=GPU_TAG_KEYS) for name, (description, _) in GPU_METRICS.items()
        }
        self.gauges[PROCESS_MEMORY_METRIC] = Gauge(
            PROCESS_MEMORY_METRIC, "GPU memory held by a process, bytes", tag_keys=PROCESS_TAG_KEYS
        )
        self.last_sample: NodeSample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-exporter", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.export_once()
            except Exception:  # a monitor never takes its host down
                logger.warning("GPU export failed; retrying in %.0f s", self.interval_s, exc_info=True)
            self._stop.wait(self.interval_s)

    def export_once(self) -> NodeSample:
        sample = self.sampler.sample_all()
        live_pids = {p.pid for gpu in sample.gpus for p in gpu.processes or []}
        self.actor_of_pid.forget_except(live_pids)
        self.actor_of_pid.label(sample)
        for name, value, tags in metric_points(sample):
            self.gauges[name].set(value, tags=tags)
        self.last_sample = sample
        return sample

    def sample(self) -> NodeSample:
        """A fresh sample of this node's GPUs, processes labelled with their actors (not exported; the loop does that)."""
        return self.actor_of_pid.label(self.sampler.sample_all())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)
        self.sampler.close()


@ray.remote(num_cpus=0)
def _sample_once() -> NodeSample:
    sampler = NvmlSampler(node=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id())
    try:
        return sampler.sample_all()
    finally:
        sampler.close()


def actor_name(node_id: str) -> str:
    return f"{ACTOR_NAME_PREFIX}{node_id}"


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def start_exporters(
    interval_s: float = 5.0, detached: bool = True, nodes: list[dict] | None = None
) -> list[ray.actor.ActorHandle]:
    """One exporter per node of `nodes` (default: every alive node), pinned there; idempotent (an existing one
    is reused).

    Detached by default so the exporters outlive the `jobs/monitor.py start` driver.
    """
    if interval_s <= 0:
        raise ValueError(f"--interval-s must be > 0, got {interval_s}")
    handles = []
    for node in alive_nodes() if nodes is None else nodes:
        node_id = node["NodeID"]
        options: dict[str, Any] = {
            "name": actor_name(node_id),
            "namespace": NAMESPACE,
            "get_if_exists": True,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        }
        if detached:
            options["lifetime"] = "detached"
        # `ray.remote` made the class an ActorClass; mypy reads a class decorator as leaving it as it was
        # (python/mypy#3135)
        exporter = GpuExporter.options(**options)  # type: ignore[attr-defined]
        handles.append(exporter.remote(interval_s, node.get("NodeManagerAddress")))
    return handles


def start_if_wanted(setting: bool | None, interval_s: float = 5.0) -> bool:
    """What training and serving call: start the exporters if `setting`, or, for None, if the cluster has GPUs.

    Never raises: a monitor must not take its host job down.
    """
    try:
        if setting is False or (setting is None and not ray.cluster_resources().get("GPU")):
            return False
        start_exporters(interval_s=interval_s)
        return True
    except Exception as error:
        logger.warning("could not start the GPU exporters (%r); the job goes on without them", error)
        return False


def exporter_names() -> list[str]:
    """Names of the running exporters, on any node (including nodes that have since died)."""
    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(ACTOR_NAME_PREFIX)
    )


def nodes_without_exporter() -> list[dict]:
    """The alive nodes that have no exporter (nodes that joined after `start`, or all before it)."""
    running = set(exporter_names())
    return [node for node in alive_nodes() if actor_name(node["NodeID"]) not in running]


@ray.remote(num_cpus=0, max_restarts=-1)
class ExporterKeeper:
    """Every `period_s`, starts an exporter (sampling every `interval_s`) on each alive node that has none."""

    def __init__(self, interval_s: float = 5.0, period_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="exporter-keeper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                started = start_exporters(self.interval_s, nodes=nodes_without_exporter())
                if started:
                    logger.info("started a GPU exporter on %d node(s) that had none", len(started))
            except Exception:  # a monitor never takes its host down
                logger.warning("checking the nodes for exporters failed; retrying in %.0f s", self.period_s,
                               exc_info=True)  # fmt: skip

    def settings(self) -> tuple[float, float]:
        """(interval_s, period_s) it runs with."""
        return self.interval_s, self.period_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def start_keeper(interval_s: float = 5.0, period_s: float = 10.0) -> ray.actor.ActorHandle:
    """The detached keeper that gives each node joining later an exporter; idempotent (a running one is kept,
    with a warning if it runs with other settings). Returns once it runs."""
    if interval_s <= 0:
        raise ValueError(f"--interval-s must be > 0, got {interval_s}")
    if period_s <= 0:
        raise ValueError(f"--node-check-period-s must be > 0, got {period_s}")
    # an ActorClass, which mypy does not see (python/mypy#3135, as for GpuExporter in start_exporters)
    keeper = ExporterKeeper.options(  # type: ignore[attr-defined]
        name=KEEPER_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote(interval_s, period_s)
    running = tuple(ray.get(keeper.settings.remote(), timeout=120))
    if running != (interval_s, period_s):
        logger.warning("an exporter keeper already runs (exporters sampling every %g s, nodes checked every %g s); "
                       "`stop`, then `start`, to change that", *running)  # fmt: skip
    return keeper


def stop_keeper(timeout_s: float = 30.0) -> bool:
    """Stop the keeper, so that it starts no more exporters; returns whether one was running."""
    try:
        keeper = ray.get_actor(KEEPER_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    try:
        ray.get(keeper.stop.remote(), timeout=timeout_s)
    except Exception as error:  # a dead or stuck keeper is killed all the same
        logger.warning("the exporter keeper did not stop cleanly (%r); killing it", error)
    ray.kill(keeper)
    return True


def stop_exporters(timeout_s: float = 10.0) -> int:
    """Stop every exporter (its sampling thread, then the actor); returns how many were running."""
    names = exporter_names()
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # stopped meanwhile
            continue
        try:
            ray.get(handle.stop.remote(), timeout=timeout_s)
        except Exception as error:  # a dead or stuck exporter is killed all the same
            logger.warning("exporter %s did not stop cleanly (%r); killing it", name, error)
        ray.kill(handle)
    return len(names)


def collect_samples(timeout_s: float = 30.0) -> list[NodeSample]:
    """A fresh sample from every alive node: from its exporter, else from a one-shot task pinned there."""
    pending = []
    for node in alive_nodes():
        node_id = node["NodeID"]
        try:
            pending.append((node, ray.get_actor(actor_name(node_id), namespace=NAMESPACE).sample.remote(), True))
        except ValueError:  # no exporter on this node
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            pending.append((node, _sample_once.options(scheduling_strategy=strategy).remote(), False))
    samples = []
    for node, ref, from_exporter in pending:
        try:
            sample = ray.get(ref, timeout=timeout_s)
        except Exception as error:
            label = node.get("NodeManagerAddress") or node["NodeID"]
            sample = NodeSample(label, available=False, reason=f"could not sample: {error!r}", node_id=node["NodeID"])
        sample.from_exporter = from_exporter
        samples.append(sample)
    return samples
