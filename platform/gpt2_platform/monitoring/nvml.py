"""Sample every NVIDIA GPU on this host through nvidia-ml-py, never raising.

A monitor must not take its host down: every NVML call is guarded, a failing
call leaves its field None ("no data"), and a host without a driver or library
gives `available=False` with a plain reason.

On a machine without GPUs, tests give a node's processes a stand-in for pynvml
through `GPT2_PLATFORM_NVML` in its environment (`NVML_STAND_IN_VAR`).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

NVML_STAND_IN_VAR = "GPT2_PLATFORM_NVML"
"""Environment variable naming a stand-in for pynvml as `module:attribute` (an object with pynvml's functions,
or a class or function that makes one) or `module`; for tests without a GPU. Unset, the sampler uses pynvml."""


@dataclass
class GpuProcess:
    """A process holding memory on a GPU."""

    pid: int
    used_memory_bytes: int | None
    ray_actor: str = ""
    """The Ray actor living in this process ("Class:name"), filled in by the exporter; "" if none or unknown."""


@dataclass
class GpuSample:
    """One GPU at one moment; a field NVML could not read is None."""

    index: int
    uuid: str | None = None
    name: str | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_mhz: float | None = None
    processes: list[GpuProcess] | None = None


@dataclass
class NodeSample:
    """Every GPU of one node; `available=False` (with `reason`) when NVML cannot be used there."""

    node: str
    """The node's address (several Ray nodes on one host share it)."""
    available: bool
    reason: str = ""
    gpus: list[GpuSample] = field(default_factory=list)
    node_id: str = ""
    """The Ray node's id (hex), unique per Ray node; "" outside Ray."""
    from_exporter: bool = False
    """Whether the node's exporter took this sample (else a one-shot task did)."""


def _load_nvml() -> tuple[ModuleType | Any | None, str]:
    """pynvml, or the stand-in that NVML_STAND_IN_VAR names, and ""; or None and why neither can be used."""
    stand_in = os.environ.get(NVML_STAND_IN_VAR)
    if stand_in:
        module_name, _, attribute = stand_in.partition(":")
        try:
            module = importlib.import_module(module_name)
            value = getattr(module, attribute) if attribute else module
            nvml = value() if callable(value) else value
        except Exception as error:  # a monitor never takes its host down: "no data", with the reason
            return None, f"{NVML_STAND_IN_VAR}={stand_in} could not be loaded: {error!r}"
        logger.warning("GPU samples come from a stand-in for NVML (%s=%s), not from GPUs", NVML_STAND_IN_VAR, stand_in)
        return nvml, ""
    try:
        import pynvml
    except Exception as error:  # an ImportError, or a broken install
        logger.debug("pynvml import failed: %s", error)
        return None, "nvidia-ml-py (pynvml) is not installed"
    return pynvml, ""


class NvmlSampler:
    """Reads all GPUs of this host; `nvml` is the pynvml module (tests pass a fake, or name one in
    NVML_STAND_IN_VAR)."""

    def __init__(self, nvml: Any = None, node: str | None = None, node_id: str = "") -> None:
        self.nvml, self._unusable_reason = (nvml, "") if nvml is not None else _load_nvml()
        self.node = node or socket.gethostname()
        self.node_id = node_id
        self._initialized = False
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def _error_types(self) -> tuple[type[BaseException], ...]:
        nvml_error = getattr(self.nvml, "NVMLError", None)
        return (nvml_error, Exception) if isinstance(nvml_error, type) else (Exception,)

    def _call(self, what: str, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)`, or None if it raises (logged once per `what` at debug)."""
        try:
            return function(*args)
        except self._error_types() as error:
            if what not in self._logged:
                self._logged.add(what)
                logger.debug("NVML %s failed on %s: %r", what, self.node, error)
            return None

    def _init(self) -> str:
        """Initialize NVML once; return "" on success, else the reason it cannot be used."""
        if self._initialized:
            return ""
        if self.nvml is None:
            return self._unusable_reason
        try:
            self.nvml.nvmlInit()
        except self._error_types() as error:
            return f"NVML could not start (no NVIDIA driver?): {error}"
        self._initialized = True
        return ""

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                assert self.nvml is not None  # _init succeeds only with a library
                self._call("nvmlShutdown", self.nvml.nvmlShutdown)
                self._initialized = False

    def sample_all(self) -> NodeSample:
        """A fresh sample of every GPU; never raises."""
        with self._lock:
            try:
                reason = self._init()
                if reason:
                    return self._unavailable(reason)
                nvml = self.nvml
                assert nvml is not None  # _init succeeds only with a library
                count = self._call("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
                if count is None:
                    return self._unavailable("NVML could not count the GPUs")
                if count == 0:
                    return self._unavailable("NVML reports 0 GPUs")
                gpus = [self._sample_gpu(nvml, i) for i in range(count)]
                return NodeSample(self.node, available=True, gpus=gpus, node_id=self.node_id)
            except Exception as error:  # a bug here must still not take the host down
                logger.debug("GPU sampling failed on %s", self.node, exc_info=True)
                return self._unavailable(f"sampling failed: {error!r}")

    def _unavailable(self, reason: str) -> NodeSample:
        return NodeSample(self.node, available=False, reason=reason, node_id=self.node_id)

    def _sample_gpu(self, nvml: Any, index: int) -> GpuSample:
        sample = GpuSample(index=index)
        handle = self._call("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return sample
        sample.name = _text(self._call("nvmlDeviceGetName", nvml.nvmlDeviceGetName, handle))
        sample.uuid = _text(self._call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle))
        rates = self._call("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None:
            sample.utilization_gpu_percent = _number(getattr(rates, "gpu", None))
            sample.utilization_memory_percent = _number(getattr(rates, "memory", None))
        memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            sample.memory_used_bytes = _integer(getattr(memory, "used", None))
            sample.memory_total_bytes = _integer(getattr(memory, "total", None))
        power_milliwatts = self._call("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, handle)
        if power_milliwatts is not None:
            sample.power_watts = power_milliwatts / 1000.0
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        sample.temperature_celsius = _number(
            self._call("nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, handle, sensor)
        )
        sm_clock = getattr(nvml, "NVML_CLOCK_SM", 1)
        sample.sm_clock_mhz = _number(
            self._call("nvmlDeviceGetClockInfo", nvml.nvmlDeviceGetClockInfo, handle, sm_clock)
        )
        processes = self._call(
            "nvmlDeviceGetComputeRunningProcesses", nvml.nvmlDeviceGetComputeRunningProcesses, handle
        )
        if processes is not None:
            sample.processes = [
                GpuProcess(pid=int(p.pid), used_memory_bytes=_integer(getattr(p, "usedGpuMemory", None)))
                for p in processes
            ]
        return sample


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _integer(value: Any) -> int | None:
    # NVML reports an unknown per-process usage as None (older drivers: a huge sentinel).
    return None if value is None or value >= 2**63 else int(value)


def format_status(samples: list[NodeSample]) -> str:
    """A plain per-node, per-GPU table; a node without GPUs gets one line saying why."""
    lines: list[str] = []
    header = f"{'node':<24} {'gpu':>3} {'name':<24} {'util%':>5} {'mem%':>5} {'mem used/total GiB':>19} {'W':>6} {'C':>4} {'SM MHz':>6}  processes (pid:GiB(actor))"
    rows: list[str] = []
    for node in samples:
        if not node.available:
            lines.append(f"no NVIDIA GPU on node {_node_label(node)} ({node.reason})")
            continue
        for gpu in node.gpus:
            memory = f"{_gib(gpu.memory_used_bytes)}/{_gib(gpu.memory_total_bytes)}"
            processes = " ".join(_process(p) for p in gpu.processes or []) or "-"
            rows.append(
                f"{_node_label(node):<24} {gpu.index:>3} {_show(gpu.name):<24} {_show(gpu.utilization_gpu_percent, 0):>5} "
                f"{_show(gpu.utilization_memory_percent, 0):>5} {memory:>19} {_show(gpu.power_watts, 0):>6} "
                f"{_show(gpu.temperature_celsius, 0):>4} {_show(gpu.sm_clock_mhz, 0):>6}  {processes}"
            )
    if rows:
        lines = [header, *rows, *lines]
    return "\n".join(lines) if lines else "no nodes"


def _node_label(node: NodeSample) -> str:
    # Several Ray nodes on one host share its address: the start of the node id tells them apart.
    return f"{node.node} {node.node_id[:8]}" if node.node_id else node.node


def _process(process: GpuProcess) -> str:
    label = f"{process.pid}:{_gib(process.used_memory_bytes)}"
    return f"{label}({process.ray_actor})" if process.ray_actor else label


def _show(value: Any, digits: int | None = None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if digits is not None else str(value)


def _gib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.1f}"
