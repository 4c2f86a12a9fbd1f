"""Start the Serve app for a benchmark: a preset with fresh weights on the local Ray, configured as the YAML does.

Lets `jobs/bench_serve.py --start-preset gpt2` measure a GPU replica in one command,
with nothing to download (the byte tokenizer; the engine samples only ids it can decode).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpt2_platform.bench.models import write_model

logger = logging.getLogger(__name__)

APP_NAME = "gpt2-bench"


# How HTTP reaches the ingress replicas: Serve's Python proxy actor (the default), direct ingress (the
# one ingress replica listens on the Serve port itself), or HAProxy (a C proxy balancing every ingress
# replica, each listening on a port of its own). Serve reads these when it starts.
INGRESS_MODES = {
    "proxy": {},
    "direct": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
}


def start(
    preset_name: str,
    model_dir: Path,
    port: int,
    max_batch_size: int,
    max_seq_len: int,
    compile_step: bool | None = None,
    gpu_monitor: bool | None = None,
    stream_interval_ms: float = 20.0,
    ingress_replicas: int = 1,
    ingress: str = "proxy",
    compile_cache_dir: str | None = None,
) -> dict[str, Any]:
    """Write the model, start Serve on `port` and deploy `ingress_replicas` ingress replicas in front of
    one engine (on the GPU if there is one); returns what was deployed."""
    import os

    import ray
    import torch
    from ray import serve

    from gpt2_platform.monitoring import exporter
    from gpt2_platform.runtime import init_ray
    from gpt2_platform.serve.app import gpt2_deployment

    if ingress not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {sorted(INGRESS_MODES)}, got {ingress!r}")
    if ingress == "direct" and ingress_replicas != 1:
        raise ValueError("direct ingress serves the port from one ingress replica; use haproxy for several")
    os.environ.update(INGRESS_MODES[ingress])  # before Ray starts: its processes inherit this environment
    torch.manual_seed(0)
    write_model(model_dir, preset_name)
    init_ray()
    exporter.start_if_wanted(gpu_monitor)
    num_gpus = 1 if ray.cluster_resources().get("GPU") else 0
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(model_dir),
        "served_model_name": preset_name,
        "engine": {
            "max_batch_size": max_batch_size,
            "max_seq_len": max_seq_len,
            "compile": compile_step,
            "compile_cache_dir": compile_cache_dir,
        },
        # Room for the whole sweep: a benchmark measures the engine, not the admission limits.
        "limits": {
            "max_waiting": 4 * max_batch_size,
            "max_tokens_cap": max_seq_len,
            "stream_interval_ms": stream_interval_ms,
        },
    }
    started = time.perf_counter()
    app = gpt2_deployment(
        args,
        engine_options={"ray_actor_options": {"num_gpus": num_gpus, "num_cpus": 1}},
        num_replicas=ingress_replicas,
        max_ongoing_requests=8 * max_batch_size,
        ray_actor_options={"num_cpus": 1},
    )
    ready_s, run_s = _deploy(serve, app, started)
    logger.info(
        "app ready in %.1f s, serve.run returned at %.1f s (%d ingress replicas, engine on %d GPU)",
        ready_s,
        run_s,
        ingress_replicas,
        num_gpus,
    )
    return {
        "args": args,
        "num_gpus": num_gpus,
        "ingress": ingress,
        "ingress_replicas": ingress_replicas,
        "replica_ready_s": ready_s,
        "serve_run_s": run_s,
        "url": f"http://127.0.0.1:{port}",
    }


def _deploy(serve, app, started: float, poll_s: float = 0.05) -> tuple[float, float]:
    """Deploy `app`; returns the seconds from `started` until Serve reported it RUNNING and until
    `serve.run` returned. `serve.run` checks the application's status once a second (Ray Serve's
    CLIENT_POLLING_INTERVAL_S), so it returns up to a second after the replicas are ready; the status is
    polled here every `poll_s` too, so the ready time is the replicas', not that poll's."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(serve.run, app, name=APP_NAME, route_prefix="/")
        ready_at = None
        while not running.done():
            status = serve.status().applications.get(APP_NAME)
            if ready_at is None and status is not None and status.status == "RUNNING":
                ready_at = time.perf_counter()
            time.sleep(poll_s)
        running.result()  # a deployment that failed raises here
    returned_at = time.perf_counter()
    return (ready_at or returned_at) - started, returned_at - started


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
