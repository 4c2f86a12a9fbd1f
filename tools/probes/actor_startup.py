"""Probe: where a Ray actor's start-up goes, from `.remote()` to its constructor's first line.

    python tools/probes/actor_startup.py [--json-out F]

Written when the batch job's GPU actor reached our constructor many seconds after its process started on
a GPU machine, for imports that take a few seconds in a plain Python on the CPU testbed
(docs/benchmarks/2026-12-01-s6-s7-pdl-startup-h200.md).
This starts Ray as the jobs do (`init_ray`: on a local cluster the package reaches workers by PYTHONPATH)
and times, each from the driver's `.remote()` and from the worker process's own start:

- an empty actor, without and with a GPU;
- an actor that imports, one after the other, what the batch actor imports (Ray Data, torch,
  transformers, our worker module), timing each import, then initialises CUDA;
- a Ray Data `map_batches` over 1,024 rows with an empty callable class on one GPU actor;
- the same imports in a plain Python process, outside Ray.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import ray  # noqa: E402

from gpt2_platform.runtime import init_ray  # noqa: E402
from gpt2_platform.worker_process import process_age_s  # noqa: E402

IMPORTS = ("ray.data", "torch", "transformers", "gpt2_platform.batch.worker")


def timed_imports() -> dict:
    import importlib

    times = {"process_age_at_start_s": process_age_s()}
    for name in IMPORTS:
        started = time.perf_counter()
        importlib.import_module(name)
        times[name] = round(time.perf_counter() - started, 2)
    import torch

    if torch.cuda.is_available():
        started = time.perf_counter()
        torch.zeros(1, device="cuda")
        times["cuda_init"] = round(time.perf_counter() - started, 2)
    return times


@ray.remote
class Empty:
    def __init__(self) -> None:
        self.at = time.time()
        self.age = process_age_s()

    def ready(self) -> tuple[float, float | None]:
        return self.at, self.age


@ray.remote
class Importer:
    def __init__(self) -> None:
        self.at = time.time()
        self.times = timed_imports()

    def ready(self) -> tuple[float, dict]:
        return self.at, self.times


def actor(cls, **options) -> dict:
    called = time.time()
    handle = cls.options(**options).remote()
    at, detail = ray.get(handle.ready.remote())
    result = {"remote_to_constructor_s": round(at - called, 2), "ready_s": round(time.time() - called, 2)}
    result["detail"] = detail
    ray.kill(handle)
    return result


class EmptyBatch:
    def __init__(self) -> None:
        self.age = process_age_s()
        self.at = time.time()

    def __call__(self, batch: dict) -> dict:
        batch["age"] = [self.age] * len(batch["id"])
        batch["at"] = [self.at] * len(batch["id"])
        return batch


def ray_data(gpus: float) -> dict:
    from ray.data import ActorPoolStrategy

    called = time.time()
    rows = (
        ray.data.range(1024)
        .map_batches(EmptyBatch, compute=ActorPoolStrategy(size=1), num_gpus=gpus, batch_size=256)
        .take_all()
    )
    return {
        "execute_to_constructor_s": round(rows[0]["at"] - called, 2),
        "worker_age_at_constructor_s": rows[0]["age"],
        "total_s": round(time.time() - called, 2),
    }


def plain_python() -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += "from actor_startup import timed_imports; print(json.dumps(timed_imports()))"
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {"total_s": round(time.perf_counter() - started, 2), "detail": json.loads(out.strip().splitlines()[-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    results = {"plain python imports": plain_python()}
    started = time.perf_counter()
    init_ray()
    results["init_ray_s"] = round(time.perf_counter() - started, 2)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    results["empty actor"] = actor(Empty)
    results["empty actor, again"] = actor(Empty)
    results[f"empty actor, {gpus} GPU"] = actor(Empty, num_gpus=gpus)
    results[f"importing actor, {gpus} GPU"] = actor(Importer, num_gpus=gpus)
    results[f"ray data map_batches, {gpus} GPU"] = ray_data(gpus)
    results[f"ray data map_batches, {gpus} GPU, again"] = ray_data(gpus)
    for name, value in results.items():
        print(f"{name}: {json.dumps(value)}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
