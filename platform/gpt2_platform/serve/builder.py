"""The app builder's checks and Serve options: what `build_app` refuses before Serve touches a running
deployment, the paths it resolves where the user typed them, and the deployments' default options.

serve/app.py binds the deployments with what these return; `build_app` stays there, where the
deployment configs' `import_path: gpt2_platform.serve.app:build_app` finds it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from gpt2_platform import checkpoint
from gpt2_platform.serve import schemas

logger = logging.getLogger(__name__)


def default_max_ongoing_requests(args: schemas.AppArgs) -> int:
    """Enough that Serve hands on what the engine could batch, the requests we refuse with 429 ourselves
    (in JSON, with Retry-After, where Serve's own queue-full 503 is plain text), and clients still
    sending their bodies (each holds a slot for up to limits.body_timeout_s): an idle request in a
    replica costs a coroutine, not engine work, which our own admission check bounds."""
    return max(1024, 2 * (args.engine.max_slots + args.limits.max_waiting))


def resolve_args(args: schemas.AppArgs | dict[str, Any], options: dict[str, Any]) -> schemas.AppArgs:
    """The app's args, checked and with local paths made absolute; `options` are the ingress's Serve options
    (their runtime_env may hold the API key)."""
    app_args: schemas.AppArgs = args if isinstance(args, schemas.AppArgs) else schemas.AppArgs.model_validate(args)
    _check_api_key_env(app_args, options)
    tokenizer = None if app_args.tokenizer is None else _local_path(app_args.tokenizer, "tokenizer")
    # The served name defaults to the model as the user wrote it, not to the resolved path.
    update = {
        "model": _local_path(app_args.model, "model"),
        "tokenizer": tokenizer,
        "served_model_name": app_args.model_name,
    }
    app_args = app_args.model_copy(update=update)
    _check_checkpoint(app_args.model)
    return app_args


def ingress_options(args: schemas.AppArgs, options: dict[str, Any]) -> dict[str, Any]:
    """The ingress's (GPT2Server's) Serve options: those given, over the defaults for these args."""
    options = dict(options)
    options.setdefault("max_ongoing_requests", default_max_ongoing_requests(args))
    options.setdefault("user_config", args.limits.model_dump())
    return options


def engine_options(args: schemas.AppArgs, options: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's (GPT2Engine's) Serve options: those given, over the defaults for these args."""
    options = dict(options or {})
    # Each sequence is one call that lasts as long as it runs: room for every sequence an engine may hold
    # before it refuses more itself (429 JSON, where Serve's own queue-full 503 is plain text).
    options.setdefault("max_ongoing_requests", default_max_ongoing_requests(args))
    # One call per sequence: a log line each would cost the engine's replica more than the call. The
    # ingress's access log still has every HTTP request.
    options.setdefault("logging_config", {"enable_access_log": False})
    return options


def _local_path(name: str, field: str) -> str:
    """An existing directory as an absolute path (replicas may start elsewhere); a hub name or 'byte' as given."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        where = ""
        if not path.is_absolute() and _in_ray_worker():
            # `serve deploy` and `serve run <config>` build the app in a task on the cluster, not in the
            # shell the user typed the path in: say so, since the path may well exist there.
            where = (
                f" (a relative path is resolved where the app is built: here, on the cluster, in {Path.cwd()}; "
                "give an absolute path that every node can read, or use `serve run "
                "gpt2_platform.serve.app:build_app model=...`, which resolves it where you type it)"
            )
        raise ValueError(
            f"{field} directory {name!r} does not exist{where}; `make demo` exports runs/demo-tiny/model, "
            f"or set args.{field} to a Hugging Face model directory or hub name"
        )
    return name


def _in_ray_worker() -> bool:
    """True in a Ray worker: for `serve deploy` / `serve run <config>`, the builder runs as a task on the
    cluster, with the application's runtime_env and the node's environment, as the replicas will."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def _check_api_key_env(args: schemas.AppArgs, options: dict[str, Any]) -> None:
    """Refuse, before Serve touches a running deployment, an app whose replicas could not read their key.

    A replica refuses to start without it, but by then Serve has already begun replacing the running
    replicas with ones that never come up. Where this builder runs on the cluster, its environment is
    the replicas' (the node's plus the application's runtime_env env_vars); elsewhere (`serve run
    module:app` and Python) it may not be, so an unset key there is only a warning.
    """
    if args.api_key_env is None:
        return
    actor_env = ((options.get("ray_actor_options") or {}).get("runtime_env") or {}).get("env_vars") or {}
    if actor_env.get(args.api_key_env) or os.environ.get(args.api_key_env):
        return
    message = (
        f"args.api_key_env is {args.api_key_env!r}, but that environment variable is unset or empty where "
        "the app is built, so its replicas could not authenticate clients; export it on every node before "
        "`ray start` (or in the pods' env), or set it in the application's runtime_env: env_vars"
    )
    if _in_ray_worker():
        raise ValueError(message)
    logger.warning("%s (the replicas refuse to start unless their environment has it)", message)


def _check_checkpoint(model: str) -> None:
    """Refuse, in the builder, a local checkpoint whose config.json this model cannot honour: before Serve
    touches a running deployment, rather than in each replica that would fail to start. (A hub name is
    checked by the replica that downloads it.)"""
    directory = Path(model)
    if (directory / checkpoint.CONFIG_NAME).is_file():
        checkpoint.read_config(directory)
