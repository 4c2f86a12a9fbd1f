"""Start the Serve app for a benchmark on the local Ray: a deployment config as it ships, only the model swapped.

`deploy_config` is what `jobs/bench_serve.py --config deployments/gpt2-cluster.yaml` and `--start-preset`
run: the file goes through Serve's own config path (`serve run config.yaml`, `serve deploy`), so every
setting a user deploys (engine batch, limits, ingress replicas and autoscaling, proxy location) is the one
measured, and no benchmark flag can give a speed the shipped config does not. A preset with fresh weights
and the byte tokenizer needs nothing downloaded (the engine samples only ids it can decode).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

APP_NAME = "gpt2-bench"


# How HTTP reaches the ingress replicas: Serve's Python proxy actor, direct ingress (the one ingress replica
# listens on the Serve port itself), or HAProxy (a C proxy balancing every ingress replica, each listening on
# a port of its own, started through serve/haproxy.py's launcher for its OpenAI-shaped errors). Serve reads
# these when it starts, from the environment `ray start` had: they belong to the cluster, not to the
# deployment file (cluster.yaml and the KubeRay manifests set HAProxy's).
INGRESS_MODES = ("proxy", "direct", "haproxy")

_own_ray = False
"""Whether deploy_config started the Ray it deployed on (then stopping that Ray stops Serve with it)."""


def ingress_environment(ingress: str) -> dict[str, str]:
    """The variables to export before Ray starts for `ingress`."""
    from gpt2_platform.serve import haproxy

    if ingress == "direct":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    if ingress == "haproxy":
        return haproxy.environment()
    return {}


def config_engine(config_path: Path) -> dict[str, Any]:
    """The `engine:` settings of the config file's one application (for the engine-alone baseline)."""
    import yaml

    config = yaml.safe_load(Path(config_path).read_text())
    return dict(config["applications"][0].get("args", {}).get("engine") or {})


def deploy_config(
    config_path: Path,
    model_dir: Path,
    port: int,
    ingress: str = "haproxy",
    gpu_monitor: bool | None = None,
) -> dict[str, Any]:
    """Deploy the Serve config file at `config_path` on a local Ray, as `serve run` would, with its one
    application's model swapped for `model_dir` (tokenizer: the model's own) and HTTP on 127.0.0.1:`port`.

    Where the config names `api_key_env`, that variable is set (to a random key, if unset) before Ray
    starts, as a cluster's nodes have it; the key is returned for the client. Raises ValueError for a file
    that is not one gpt2_platform application."""
    import os
    import secrets

    import ray
    import yaml
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from gpt2_platform.monitoring import exporter
    from gpt2_platform.runtime import init_ray

    if ingress not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {sorted(INGRESS_MODES)}, got {ingress!r}")
    config = yaml.safe_load(Path(config_path).read_text())
    apps = config.get("applications") if isinstance(config, dict) else None
    if not apps or len(apps) != 1 or not str(apps[0].get("import_path", "")).startswith("gpt2_platform.serve"):
        raise ValueError(f"{config_path}: expected a Serve config with one gpt2_platform application")
    app = apps[0]
    app["args"] = {**app.get("args", {}), "model": str(model_dir), "tokenizer": None}
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    schema = ServeDeploySchema.model_validate(config)
    api_key = None
    if key_env := app["args"].get("api_key_env"):
        api_key = os.environ.setdefault(key_env, secrets.token_urlsafe(24))
    os.environ.update(ingress_environment(ingress))  # before Ray starts: its processes inherit this environment
    global _own_ray
    _own_ray = os.environ.get("RAY_ADDRESS", "local") == "local" and not ray.is_initialized()
    init_ray()
    exporter.start_if_wanted(gpu_monitor)
    started = time.perf_counter()
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=None,
        controller_options=schema.controller_options,
    )
    client.deploy_apps(schema)
    ready_s = _wait_running(serve, app.get("name", "default"), started)
    logger.info("%s deployed with model %s in %.1f s (%s ingress)", config_path, model_dir, ready_s, ingress)
    return {
        "config": str(config_path),
        "args": app["args"],
        "deployments": app.get("deployments", []),
        "num_gpus": ray.cluster_resources().get("GPU", 0),
        "ingress": ingress,
        "replica_ready_s": ready_s,
        "url": f"http://127.0.0.1:{port}",
        "api_key": api_key,
    }


def _wait_running(serve, name: str, started: float, timeout_s: float = 900, poll_s: float = 0.05) -> float:
    """Seconds from `started` until Serve reports application `name` RUNNING; ValueError with Serve's own
    message if it failed to deploy, TimeoutError past `timeout_s`."""
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return time.perf_counter() - started
        if status is not None and status.status == "DEPLOY_FAILED":
            raise ValueError(f"application {name} failed to deploy: {status.message}")
        time.sleep(poll_s)
    raise TimeoutError(f"application {name} was not running within {timeout_s:.0f} s")


def stop() -> None:
    import ray
    from ray import serve

    if not _own_ray:
        serve.shutdown()  # a cluster that outlives the benchmark: take the app away
    # Else Ray's shutdown ends Serve, HAProxy included; serve.shutdown would first wait for HAProxy's
    # drain (30 s, "Controller failed to shut down").
    ray.shutdown()
