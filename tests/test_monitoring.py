"""GPU monitoring: NVML sampling against a fake NVML, metric names, the status table, and exporters on real Ray.

`FakeNVML` is also what the nodes of tests/test_multinode_monitor.py load (GPT2_PLATFORM_NVML names it), in
Ray workers: so this module imports nothing heavy at its top (conftest imports torch).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpt2_platform.monitoring import exporter
from gpt2_platform.monitoring.nvml import (
    NVML_STAND_IN_VAR,
    GpuProcess,
    GpuSample,
    NodeSample,
    NvmlSampler,
    format_status,
)

PROMETHEUS_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_ID = "0a1b2c3d4e5f" * 4


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml functions the sampler calls, over 2 fake GPUs; `failing` names calls that raise NVMLError."""

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing = set(failing)
        self.initialized = False

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise FakeNVMLError(f"{name}: Not Supported")

    def nvmlInit(self) -> None:
        self._check("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        self._check("nvmlDeviceGetName")
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        self._check("nvmlDeviceGetUUID")
        return f"GPU-0000-{handle}".encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=90 + handle, memory=40 + handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=(10 + handle) * GIB, total=141 * GIB, free=(131 - handle) * GIB)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._check("nvmlDeviceGetPowerUsage")
        return 650_500 + handle * 1000  # mW

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 60 + handle

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        self._check("nvmlDeviceGetClockInfo")
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetComputeRunningProcesses")
        if handle == 0:
            return [SimpleNamespace(pid=1234, usedGpuMemory=8 * GIB), SimpleNamespace(pid=99, usedGpuMemory=None)]
        return []


def fake_sample(failing: tuple[str, ...] = ()) -> NodeSample:
    return NvmlSampler(nvml=FakeNVML(failing), node="node-a", node_id=NODE_ID).sample_all()


def test_fake_gpus_are_sampled_with_units_converted() -> None:
    sample = fake_sample()
    assert sample.available and sample.reason == "" and sample.node == "node-a" and sample.node_id == NODE_ID
    assert [gpu.index for gpu in sample.gpus] == [0, 1]
    gpu0, gpu1 = sample.gpus
    assert gpu0 == GpuSample(
        index=0,
        uuid="GPU-0000-0",
        name="NVIDIA H200",
        utilization_gpu_percent=90.0,
        utilization_memory_percent=40.0,
        memory_used_bytes=10 * GIB,
        memory_total_bytes=141 * GIB,
        power_watts=650.5,
        temperature_celsius=60.0,
        sm_clock_mhz=1980.0,
        processes=[GpuProcess(pid=1234, used_memory_bytes=8 * GIB), GpuProcess(pid=99, used_memory_bytes=None)],
    )
    assert gpu1.power_watts == pytest.approx(651.5)
    assert gpu1.memory_used_bytes == 11 * GIB and gpu1.processes == []


def test_one_failing_call_leaves_only_that_field_empty() -> None:
    sample = fake_sample(failing=("nvmlDeviceGetPowerUsage",))
    assert sample.available
    for gpu in sample.gpus:
        assert gpu.power_watts is None
        assert gpu.temperature_celsius is not None and gpu.memory_total_bytes == 141 * GIB and gpu.uuid


def test_every_call_failing_still_never_raises() -> None:
    calls = [name for name in dir(FakeNVML) if name.startswith("nvmlDevice") and name != "nvmlDeviceGetCount"]
    sample = fake_sample(failing=tuple(calls))
    assert sample.available and [gpu.index for gpu in sample.gpus] == [0, 1]
    assert all(gpu.uuid is None and gpu.power_watts is None for gpu in sample.gpus)


def test_a_non_nvml_exception_is_guarded_too() -> None:
    nvml = FakeNVML()
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 1 / 0
    sample = NvmlSampler(nvml=nvml, node="node-a").sample_all()
    assert sample.available and all(gpu.temperature_celsius is None and gpu.power_watts for gpu in sample.gpus)


def test_init_failure_means_not_available_with_a_reason() -> None:
    sample = fake_sample(failing=("nvmlInit",))
    assert not sample.available and sample.gpus == []
    assert "NVML could not start" in sample.reason and "nvmlInit" in sample.reason
    assert sample.node_id == NODE_ID


def test_a_stand_in_nvml_named_in_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NVML_STAND_IN_VAR, f"{__name__}:FakeNVML")
    sampler = NvmlSampler(node="node-a")
    assert isinstance(sampler.nvml, FakeNVML)
    sample = sampler.sample_all()
    assert sample.available and len(sample.gpus) == 2 and sample.gpus[0].name == "NVIDIA H200"


def test_a_stand_in_nvml_that_cannot_be_loaded_means_no_data_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NVML_STAND_IN_VAR, f"{__name__}:NoSuchNVML")
    sample = NvmlSampler(node="node-a").sample_all()
    assert not sample.available and sample.gpus == []
    assert sample.reason.startswith(f"{NVML_STAND_IN_VAR}={__name__}:NoSuchNVML could not be loaded: ")


def test_the_real_pynvml_here_degrades_without_raising() -> None:
    sampler = NvmlSampler()  # this machine has no NVIDIA driver
    sample = sampler.sample_all()
    sampler.close()
    if sample.available:
        pytest.skip("this machine has an NVIDIA driver")
    assert sample.reason and sample.gpus == []


def test_metric_names_are_prometheus_valid() -> None:
    assert len(exporter.METRIC_NAMES) == 8
    for name in exporter.METRIC_NAMES:
        assert PROMETHEUS_NAME.fullmatch(name), name
        assert exporter.validate_metric_name(name) == name
    for bad in ("gpt2-gpu-power", "gpu.power", "1gpu", "gpu power", ""):
        with pytest.raises(ValueError, match="not valid for Prometheus"):
            exporter.validate_metric_name(bad)


def test_metric_points_carry_values_and_tags() -> None:
    sample = fake_sample()
    for process in sample.gpus[0].processes:
        process.ray_actor = f"TrainWorker:{process.pid}"  # what RayActorLookup.label fills in
    points = exporter.metric_points(sample)
    by_key = {(name, tags["gpu"], tags.get("pid")): (value, tags) for name, value, tags in points}
    value, tags = by_key[("gpt2_gpu_power_watts", "0", None)]
    assert value == 650.5 and tags == {"node": "node-a", "node_id": NODE_ID, "gpu": "0", "uuid": "GPU-0000-0"}
    assert by_key[("gpt2_gpu_memory_total_bytes", "1", None)][0] == 141 * GIB
    value, tags = by_key[("gpt2_gpu_process_memory_bytes", "0", "1234")]
    assert value == 8 * GIB and tags["ray_actor"] == "TrainWorker:1234" and tags["uuid"] == "GPU-0000-0"
    assert ("gpt2_gpu_process_memory_bytes", "0", "99") not in by_key  # unknown usage: no point
    assert {name for name, _, _ in points} == set(exporter.METRIC_NAMES)
    assert all(isinstance(v, str) for _, _, tags in points for v in tags.values())


def test_metric_points_skip_empty_fields_and_unavailable_nodes() -> None:
    points = exporter.metric_points(fake_sample(failing=("nvmlDeviceGetPowerUsage",)))
    assert points and "gpt2_gpu_power_watts" not in {name for name, _, _ in points}
    assert exporter.metric_points(NodeSample("node-b", available=False, reason="no driver")) == []


def test_status_table_renders_gpus_and_gpu_less_nodes() -> None:
    table = format_status(
        [fake_sample(failing=("nvmlDeviceGetTemperature",)), NodeSample("node-b", False, "no driver")]
    )
    lines = table.splitlines()
    assert lines[0].startswith("node") and "SM MHz" in lines[0]
    assert "NVIDIA H200" in lines[1] and "650" in lines[1] and "10.0/141.0" in lines[1] and "1234:8.0" in lines[1]
    assert lines[1].startswith(f"node-a {NODE_ID[:8]} ")  # nodes on one host differ by their node id
    assert "n/a" in lines[1]  # the failed temperature
    assert lines[-1] == "no NVIDIA GPU on node node-b (no driver)"
    assert format_status([NodeSample("vm", False, "NVML Shared Library Not Found")]) == (
        "no NVIDIA GPU on node vm (NVML Shared Library Not Found)"
    )


def test_the_keeper_refuses_a_period_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="--node-check-period-s must be > 0, got 0"):
        exporter.start_keeper(period_s=0)


def _load_main() -> Callable[[list[str]], int]:
    # jobs/ is not a package: load the script as a module from its path.
    spec = importlib.util.spec_from_file_location("jobs_monitor", REPO_ROOT / "jobs" / "monitor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_exporters_on_real_ray(ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    monitor_main = _load_main()
    # No exporter yet: status samples through a one-shot task pinned to each node.
    assert monitor_main(["status"]) == 0
    assert "no NVIDIA GPU on node" in capsys.readouterr().out

    assert len(exporter.nodes_without_exporter()) == 1
    first = exporter.start_exporters(interval_s=0.5)
    try:
        assert exporter.nodes_without_exporter() == []
        second = exporter.start_exporters(interval_s=0.5)
        assert len(first) == len(second) == 1
        assert first[0]._actor_id == second[0]._actor_id
        sample = ray.get(first[0].sample.remote(), timeout=60)
        assert not sample.available and sample.reason  # no NVIDIA GPU here
        assert sample.node_id == ray.get_runtime_context().get_node_id()

        assert monitor_main(["status"]) == 0
        out = capsys.readouterr().out
        assert "no NVIDIA GPU on node" in out and "1 of 1 node(s) have a GPU exporter" in out, out
        assert monitor_main(["status", "--json"]) == 0
        assert '"available": false' in capsys.readouterr().out

        assert exporter.exporter_names() == [exporter.actor_name(ray.get_runtime_context().get_node_id())]
        assert monitor_main(["stop"]) == 0
        assert "no exporter keeper was running; stopped 1 GPU exporter(s)" in capsys.readouterr().out
        assert exporter.exporter_names() == []
        assert monitor_main(["stop"]) == 0
        assert "stopped 0 GPU exporter(s)" in capsys.readouterr().out
    finally:
        for handle in first:
            ray.kill(handle)


@pytest.mark.slow
def test_a_gpu_process_is_labelled_with_the_ray_actor_living_in_it(ray_cluster: None) -> None:
    import os

    import ray

    @ray.remote(num_cpus=0)
    class TrainWorker:
        def pid(self) -> int:
            return os.getpid()

    worker = TrainWorker.options(name="rank-0").remote()
    try:
        pid = ray.get(worker.pid.remote(), timeout=60)
        # The fake NVML reports the actor's real process on a GPU; Ray's state API names the actor.
        sample = NodeSample("node-a", True, gpus=[GpuSample(0, processes=[GpuProcess(pid, 2 * GIB)])])
        lookup = exporter.RayActorLookup(miss_retry_s=0.0)
        labelled = lookup.label(sample)
        assert labelled.gpus[0].processes[0].ray_actor == "TrainWorker:rank-0"
        assert f"{pid}:2.0(TrainWorker:rank-0)" in format_status([labelled])
        (point,) = [p for p in exporter.metric_points(labelled) if p[0] == exporter.PROCESS_MEMORY_METRIC]
        assert point[2]["ray_actor"] == "TrainWorker:rank-0"
        assert lookup(os.getpid()) == ""  # the test process holds no actor
    finally:
        ray.kill(worker)


@pytest.mark.slow
def test_monitor_without_ray_address_starts_an_embedded_ray_with_a_private_token(tmp_path: Path) -> None:
    """The jobs' embedded Ray (runtime.init_ray): its token is made 0600 before Ray would write it 0644, and
    Ray's notice that it turned token auth on is gone. The test session's own Ray runs beside it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "jobs" / "monitor.py"), "status"],
        env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "no NVIDIA GPU on node" in done.stdout
    token = tmp_path / ".ray" / "auth_token"
    assert oct(token.stat().st_mode & 0o777) == oct(0o600) and len(token.read_text()) == 64
    assert oct(token.parent.stat().st_mode & 0o777) == oct(0o700)
    assert "Token authentication is enabled" not in done.stderr, done.stderr[-3000:]
    assert "Generated new authentication token" not in done.stderr


def test_monitor_against_a_dashboard_url_that_nothing_answers_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", url)
    assert _load_main()(["status"]) == 2
    assert capsys.readouterr().out.startswith(f"error: no Ray dashboard answers at {url}")
