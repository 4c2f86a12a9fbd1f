"""Connecting to Ray: the same call starts an embedded local cluster or joins a running one."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

import gpt2_platform

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(gpt2_platform.__file__).resolve().parent


def package_runtime_env() -> dict:
    """Ship this package to every worker, so jobs run the code the driver has.

    Inside `ray job submit --working-dir .` the workers' sys.path holds the
    working dir, not `platform/`; `py_modules` puts the package on it. Ray
    merges this with the job's own runtime env (working_dir, env_vars).
    """
    return {"py_modules": [str(PACKAGE_DIR)]}


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to RAY_ADDRESS / `address` if set, else start a local Ray; no-op if connected."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict = {"runtime_env": package_runtime_env(), "log_to_driver": True}
    if address is None and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(address=address, **kwargs)
    logger.info("Ray %s: %s", ray.__version__, ray.cluster_resources())
