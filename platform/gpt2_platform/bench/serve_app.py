"""Start the Serve app for a benchmark: a preset with fresh weights on the local Ray, configured as the YAML does.

Lets `jobs/bench_serve.py --start-preset gpt2` measure a GPU replica in one command,
with nothing to download (the byte tokenizer; the engine samples only ids it can decode).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gpt2_platform.bench.batch import write_model

logger = logging.getLogger(__name__)

APP_NAME = "gpt2-bench"


def start(
    preset_name: str,
    model_dir: Path,
    port: int,
    max_batch_size: int,
    max_seq_len: int,
    compile_step: bool | None = None,
    gpu_monitor: bool | None = None,
    stream_interval_ms: float = 20.0,
    engine_process: bool = False,
) -> dict[str, Any]:
    """Write the model, start Serve on 127.0.0.1:`port` and deploy one replica; returns what was deployed.

    `engine_process` is ignored (with a warning): the app no longer runs its engine in a child process.
    """
    import ray
    import torch
    from ray import serve

    from gpt2_platform.monitoring import exporter
    from gpt2_platform.runtime import init_ray
    from gpt2_platform.serve.app import gpt2_deployment

    if engine_process:
        logger.warning("engine_process is ignored: the engine no longer runs in a child process of the replica")
    torch.manual_seed(0)
    write_model(model_dir, preset_name)
    init_ray()
    exporter.start_if_wanted(gpu_monitor)
    num_gpus = 1 if ray.cluster_resources().get("GPU") else 0
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(model_dir),
        "served_model_name": preset_name,
        "engine": {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "compile": compile_step},
        # Room for the whole sweep: a benchmark measures the engine, not the admission limits.
        "limits": {
            "max_waiting": 4 * max_batch_size,
            "max_tokens_cap": max_seq_len,
            "stream_interval_ms": stream_interval_ms,
        },
    }
    started = time.perf_counter()
    app = gpt2_deployment(
        args, max_ongoing_requests=8 * max_batch_size, ray_actor_options={"num_gpus": num_gpus, "num_cpus": 1}
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    ready_s = time.perf_counter() - started
    logger.info("replica ready in %.1f s (%d GPU)", ready_s, num_gpus)
    return {"args": args, "num_gpus": num_gpus, "replica_ready_s": ready_s, "url": f"http://127.0.0.1:{port}"}


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
