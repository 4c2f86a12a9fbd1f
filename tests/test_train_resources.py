"""gpt2_platform.train.resources: a run the cluster cannot hold is refused (or waited for) before Ray Train starts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import tiny_config
from gpt2_platform.train.config import ScalingConfig
from gpt2_platform.train.resources import ClusterResourcesError, cluster_room, worker_bundle, workers_that_fit
from gpt2_platform.train.trainer import fit

pytestmark = pytest.mark.slow


def test_workers_must_each_fit_on_one_node() -> None:
    bundle = {"CPU": 2.0, "GPU": 1.0}
    nodes = [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 4.0}, {"CPU": 64.0}]
    assert workers_that_fit(bundle, nodes) == 2  # 1 on the first, 1 on the second (CPU-bound), none on the third
    assert workers_that_fit({"CPU": 0.5}, [{"CPU": 1.5}]) == 3
    assert workers_that_fit({"GPU": 0.1}, [{"GPU": 1.0}]) == 10, "float shares must not lose a worker to rounding"


def test_the_bundle_is_what_ray_train_reserves() -> None:
    assert worker_bundle(ScalingConfig(cpus_per_worker=2)) == {"CPU": 2.0}
    assert worker_bundle(ScalingConfig(use_gpu=True)) == {"CPU": 1.0, "GPU": 1.0}
    assert worker_bundle(ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 0.5, "x": 0.01})) == {
        "CPU": 1.0,
        "GPU": 0.5,
        "x": 0.01,
    }


def test_the_local_cluster_counts_as_fixed_and_ray_up_types_as_autoscaled(ray_cluster) -> None:
    import ray
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    from gpt2_platform.train.resources import _v1_autoscaler_running, autoscaled_node_types

    def report() -> dict:
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return json.loads(raw) if raw else {}

    # The monitor writes a report every few seconds; its first ones may come before the autoscaler's part.
    deadline = time.monotonic() + 60
    while "autoscaler_report" not in (local := report()) and time.monotonic() < deadline:
        time.sleep(0.5)
    node_id = ray.get_runtime_context().get_node_id()
    assert local["autoscaler_report"]["node_type_mapping"] == {node_id: f"node_{node_id}"}
    assert autoscaled_node_types(local) == set() and not _v1_autoscaler_running()
    # Under `ray up cluster.yaml` the report names the config's node types (the format of `ray status`).
    ray_up = {"autoscaler_report": {"active_nodes": {"head": 1}, "node_type_mapping": {"10.0.0.1": "head"}}}
    assert autoscaled_node_types(ray_up) == {"head"}


def cluster_cpus() -> tuple[float, float]:
    import ray

    return ray.available_resources().get("CPU", 0.0), ray.cluster_resources()["CPU"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["scaling.num_workers=8"], "scaling.num_workers=8 workers of {CPU: 1} do not fit the cluster: its 1 node(s) "
         "have 4 CPU, room for 4 worker(s)"),
        (["scaling.use_gpu=true"], "scaling.use_gpu=true but no node of the cluster has a GPU; set scaling.use_gpu=false"),
        (["scaling.cpus_per_worker=6"], "no node of the cluster has 6 CPU (the largest has 4); lower scaling.cpus_per_worker"),
        (["scaling.resources_per_worker={accelerator_type:H200: 0.01}"], "asks for 'accelerator_type:H200', a resource no node"),
    ],
    ids=["too-many-workers", "gpu-without-gpus", "cpus-per-worker", "custom-resource"],
)  # fmt: skip
def test_a_run_that_never_fits_is_refused_at_once(ray_cluster, corpus: Path, tmp_path: Path, overrides, expected):
    started = time.monotonic()
    with pytest.raises(ClusterResourcesError) as error:
        fit(tiny_config(corpus, tmp_path / "runs", *overrides))
    assert expected in str(error.value)
    assert time.monotonic() - started < 30, "refused before reading data or starting workers"
    assert not (tmp_path / "runs").exists()
    free, total = cluster_cpus()
    assert free == total, "no actor left holding the cluster's CPUs"


@pytest.fixture
def three_cpus_held(ray_cluster) -> Iterator[object]:
    """An actor holding 3 of the session cluster's 4 CPUs (as a Serve app or another job would)."""
    import ray

    @ray.remote(num_cpus=3)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    yield holder
    ray.kill(holder)
    deadline = time.monotonic() + 30
    while cluster_cpus()[0] < 4 and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_run_blocked_by_other_work_waits_the_stated_time_then_refuses(three_cpus_held, corpus, tmp_path, caplog):
    started = time.monotonic()
    with pytest.raises(ClusterResourcesError) as error:
        fit(tiny_config(corpus, tmp_path / "runs", "scaling.num_workers=2", "scaling.resource_timeout_s=3"))
    waited_s = time.monotonic() - started
    assert "after waiting 3 s the cluster still has no room for scaling.num_workers=2" in str(error.value)
    assert "free 1 CPU of 4 CPU" in str(error.value) and "scaling.resource_timeout_s" in str(error.value)
    assert 3 <= waited_s < 30
    assert "waiting up to 3 s (scaling.resource_timeout_s)" in caplog.text


def test_a_run_blocked_by_other_work_goes_ahead_once_it_ends(three_cpus_held) -> None:
    import ray

    threading.Timer(2.0, ray.kill, args=(three_cpus_held,)).start()
    started = time.monotonic()
    with cluster_room(ScalingConfig(num_workers=2, resource_timeout_s=60)):
        waited_s = time.monotonic() - started
    assert 2 <= waited_s < 30, waited_s
