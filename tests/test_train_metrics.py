"""Training metrics exported as Ray metrics: names Prometheus keeps, one gauge per reported key."""

from __future__ import annotations

import re
import sys

import ray
import ray.cloudpickle

from conftest import prometheus_lines
from gpt2_platform.train.metrics import GAUGES, TrainMetrics

PROMETHEUS_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def test_every_gauge_name_is_one_prometheus_keeps():
    assert all(PROMETHEUS_NAME.fullmatch(name) for name, _ in GAUGES.values())
    assert len({name for name, _ in GAUGES.values()}) == len(GAUGES)


def test_record_exports_the_reported_keys_and_skips_missing_ones(ray_cluster):
    # Recorded from an actor, as rank 0 of a training run does. Other tests' runs export the
    # same metrics with other run tags, so the wait is for this run's line.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    recorder = Recorder.remote()
    try:
        ray.get(recorder.record.remote("run-a", {"step": 5, "loss": 2.5, "tokens_per_s": 1000.0}))  # no mfu on CPU
        (line,) = prometheus_lines("ray_gpt2_train_tokens_per_second", tag='run="run-a"')
        assert line.endswith(" 1000.0")
        assert not prometheus_lines("ray_gpt2_train_mfu", tag='run="run-a"', timeout_s=2)
    finally:
        ray.kill(recorder)


@ray.remote(num_cpus=0)
class Recorder:
    def __init__(self) -> None:
        self.metrics: dict[str, TrainMetrics] = {}

    def record(self, run: str, values: dict) -> None:
        self.metrics.setdefault(run, TrainMetrics(run)).record(values)
