"""Validate the deployment files before they reach a cluster: `ray up` configs, Serve configs, KubeRay manifests.

Each check first lets Ray's own code judge the file (the cluster launcher's schema after its provider
defaults are merged in, Serve's `ServeDeploySchema`), then adds the project's rules: token authentication
on every `ray start`, a dashboard bound to loopback, consistent autoscaling bounds, valid app args, an
API key wherever Serve listens beyond localhost, and the app's two deployments as they must be: the ingress
(GPT2Server) without GPUs, the engine (GPT2Engine) scaled on the sequences it reports. Every error names the
file, the field and the fix.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

AUTH_MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
APP_BUILDER = "gpt2_platform.serve.app:build_app"
# Serve sends a replica this many requests at most when a deployment leaves max_ongoing_requests out.
SERVE_DEFAULT_MAX_ONGOING_REQUESTS = 5
KUBERAY_API_VERSION = "ray.io/v1"
KUBERAY_KINDS = ("RayCluster", "RayService", "RayJob")
# The deployments of APP_BUILDER's app by their Serve names (serve/app.py, serve/engine_deployment.py): spelled
# out, so checking a file imports no model code (a test keeps them equal to the classes' names).
INGRESS_DEPLOYMENT = "GPT2Server"
ENGINE_DEPLOYMENT = "GPT2Engine"


class DeployConfigError(ValueError):
    """A deployment file that must not be used as it is; the message names the file, the field and the fix."""

    def __init__(self, source: str | Path, field: str, problem: str) -> None:
        self.source, self.field = str(source), field
        super().__init__(f"{source}: {field}: {problem}")


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise DeployConfigError(path, "(file)", f"not valid YAML: {error}") from None


def _pydantic_errors(error: Any) -> str:
    """`a.b.c: message; ...` from a pydantic ValidationError."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or '(top)'}: {item['msg']}" for item in error.errors()
    )


# --- `ray up` cluster configs ------------------------------------------------------------------------------


def validate_cluster_config(path: str | Path) -> dict[str, Any]:
    """Validate a cluster launcher config as `ray up` would (provider defaults merged, Ray's JSON schema),
    then require token auth on every `ray start` and a loopback-only dashboard. Returns the merged config.

    What needs the cloud (the AWS provider's resource autodetection, AMIs, credentials) is not checked.
    """
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load_yaml(path)
    if not isinstance(raw, dict) or "provider" not in raw:
        raise DeployConfigError(path, "provider", "a cluster config needs a provider block (type: aws, local, ...)")
    try:
        config = prepare_config(copy.deepcopy(raw))
        validate_config(config)
    except jsonschema.ValidationError as error:
        field = ".".join(str(part) for part in error.absolute_path) or "(top)"
        raise DeployConfigError(path, field, f"fails Ray's cluster schema: {error.message}") from None
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as error:
        raise DeployConfigError(path, "(config)", f"Ray refuses it: {error}") from None
    except SystemExit as error:  # the local provider's cli_logger.abort() exits
        raise DeployConfigError(
            path, "provider", f"Ray refuses it (exit {error.code}); run `ray up` to see why"
        ) from None
    token_from_mounts = any(_same_path(remote, DEFAULT_TOKEN_FILE) for remote in (config.get("file_mounts") or {}))
    for field, is_head in (("head_start_ray_commands", True), ("worker_start_ray_commands", False)):
        starts = [(index, command) for index, command in enumerate(config.get(field) or []) if _is_ray_start(command)]
        if not starts:
            raise DeployConfigError(path, field, "has no `ray start` command; add one (see cluster.yaml)")
        for index, command in starts:
            check_ray_start(command, f"{field}[{index}]", path, head=is_head, token_from_mounts=token_from_mounts)
    return config


def _same_path(a: str, b: str) -> bool:
    return a.rstrip("/").replace("$HOME", "~") == b.rstrip("/")


def _is_ray_start(command: str) -> bool:
    return re.search(r"(^|[\s;&|/])ray\s+start(\s|$)", command) is not None


def check_ray_start(command: str, field: str, source: str | Path, head: bool, token_from_mounts: bool) -> None:
    """One launcher command that runs `ray start`: RAY_AUTH_MODE=token set in that same shell command (each
    command runs in its own shell), a token the node can read, and on the head a loopback dashboard."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    words = list(lexer)
    start = next((i for i in range(len(words) - 1) if words[i].endswith("ray") and words[i + 1] == "start"), None)
    if start is None:
        raise DeployConfigError(source, field, "cannot find `ray start` in this command; write it as a plain command")
    before, flags = words[:start], []
    for word in words[start + 2 :]:
        if set(word) <= set(";&|()<>"):
            break
        flags.append(word)
    settings = dict(word.split("=", 1) for word in before if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word))
    if settings.get(AUTH_MODE_VAR) != "token":
        raise DeployConfigError(
            source,
            field,
            f"`ray start` runs without token authentication; begin the command with `export {AUTH_MODE_VAR}=token;`",
        )
    if not token_from_mounts and not any(settings.get(name) for name in TOKEN_VARS):
        raise DeployConfigError(
            source,
            field,
            f"no token reaches this node: add file_mounts {{'{DEFAULT_TOKEN_FILE}': '{DEFAULT_TOKEN_FILE}'}} "
            "(after `ray get-auth-token --generate` on your machine) or set RAY_AUTH_TOKEN_PATH in the command",
        )
    options = _flag_values(flags)
    if not head:
        return
    host = options.get("--dashboard-host")
    if host is None or host.strip("[]") not in LOOPBACK_HOSTS:
        raise DeployConfigError(
            source,
            field,
            f"the head's dashboard is bound to {host or 'an unspecified host'}; pass --dashboard-host=127.0.0.1 "
            "and reach it with `ray dashboard <config>` (an SSH tunnel)",
        )


def _flag_values(flags: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` pairs of a `ray start` command line."""
    values: dict[str, str] = {}
    for index, flag in enumerate(flags):
        if not flag.startswith("--"):
            continue
        if "=" in flag:
            name, value = flag.split("=", 1)
            values[name] = value
        elif index + 1 < len(flags) and not flags[index + 1].startswith("--"):
            values[flag] = flags[index + 1]
        else:
            values[flag] = ""
    return values


# --- Serve configs -----------------------------------------------------------------------------------------


def validate_serve_config(config: str | Path | dict[str, Any], source: str | None = None) -> Any:
    """Validate a Serve config file (or its dict) with Serve's `ServeDeploySchema`, then the project's rules.

    Returns the parsed `ServeDeploySchema`.
    """
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(config, dict):
        source = source or str(config)
        config = load_yaml(config)
    source = source or "(serve config)"
    if not isinstance(config, dict) or "applications" not in config:
        raise DeployConfigError(source, "applications", "a Serve config needs an applications list")
    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValidationError as error:
        raise DeployConfigError(source, "(schema)", f"fails Serve's schema: {_pydantic_errors(error)}") from None
    host = schema.http_options.host
    public = host not in LOOPBACK_HOSTS
    for app_index, app in enumerate(config["applications"]):
        app_field = f"applications[{app.get('name', app_index)}]"
        args = _check_app_args(app, app_field, source, public, host)
        for deployment in app.get("deployments") or []:
            field = f"{app_field}.deployments[{deployment.get('name')}]"
            _check_deployment(deployment, field, source, args)
    return schema


def _check_app_args(app: dict[str, Any], field: str, source: str, public: bool, host: str) -> Any:
    if app.get("import_path") != APP_BUILDER:
        return None
    from pydantic import ValidationError

    from gpt2_platform.serve.schemas import AppArgs

    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError as error:
        raise DeployConfigError(source, f"{field}.args", _pydantic_errors(error)) from None
    if public and not args.api_key_env:
        raise DeployConfigError(
            source,
            f"{field}.args.api_key_env",
            f"Serve listens on {host!r}, beyond localhost, and its port has no Ray token auth: "
            "set api_key_env (e.g. GPT2_API_KEY), or http_options.host: 127.0.0.1",
        )
    return args


def _check_deployment(deployment: dict[str, Any], field: str, source: str, args: Any) -> None:
    """Autoscaling bounds Serve only checks at deploy time, then, in an app of our builder, the rules of
    its two deployments: the HTTP ingress (GPT2Server) and the model (GPT2Engine)."""
    name = deployment.get("name")
    if args is not None and name not in (INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT):
        raise DeployConfigError(
            source,
            field,
            f"unknown deployment {name!r}: {APP_BUILDER} builds {INGRESS_DEPLOYMENT} (the HTTP ingress) and "
            f"{ENGINE_DEPLOYMENT} (the model); check the spelling",
        )
    bounds = _autoscaling_bounds(deployment, field, source)
    if args is None:
        _check_max_ongoing_reaches_target(deployment, field, source, bounds, SERVE_DEFAULT_MAX_ONGOING_REQUESTS)
    elif name == INGRESS_DEPLOYMENT:
        _check_ingress(deployment, field, source, bounds)
    else:
        _check_engine(deployment, field, source, args, bounds)


def _autoscaling_bounds(deployment: dict[str, Any], field: str, source: str) -> Any:
    """The deployment's AutoscalingConfig, or None without one (a fixed number of replicas)."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    autoscaling = deployment.get("autoscaling_config")
    if not isinstance(autoscaling, dict):
        return None
    # Serve's file schema keeps autoscaling_config a plain dict: min > max or a typo only fail at deploy time.
    unknown = sorted(set(autoscaling) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise DeployConfigError(source, f"{field}.autoscaling_config", f"unknown keys {unknown}; check the spelling")
    try:
        bounds = AutoscalingConfig.model_validate(autoscaling)
    except ValidationError as error:
        raise DeployConfigError(source, f"{field}.autoscaling_config", _pydantic_errors(error)) from None
    if bounds.target_ongoing_requests <= 0:
        raise DeployConfigError(source, f"{field}.autoscaling_config.target_ongoing_requests", "must be > 0")
    return bounds


def _check_max_ongoing_reaches_target(
    deployment: dict[str, Any], field: str, source: str, bounds: Any, default: int | None
) -> None:
    """A deployment scaled on its Serve calls: Serve sends a replica at most max_ongoing_requests of them,
    so a higher target could never be reached. `default`: what applies when the file leaves it out (None:
    the builder sizes it, so there is nothing to compare)."""
    max_ongoing = deployment.get("max_ongoing_requests", default)
    if bounds is None or max_ongoing is None or max_ongoing >= bounds.target_ongoing_requests:
        return
    raise DeployConfigError(
        source,
        f"{field}.max_ongoing_requests",
        f"{max_ongoing} is below autoscaling target_ongoing_requests {bounds.target_ongoing_requests}: "
        "the target could never be reached; raise max_ongoing_requests",
    )


def _policy_function(bounds: Any) -> str:
    function = bounds.policy.policy_function
    return function if isinstance(function, str) else f"{function.__module__}:{function.__qualname__}"


def _check_ingress(deployment: dict[str, Any], field: str, source: str, bounds: Any) -> None:
    """GPT2Server holds no model and scales on the HTTP requests it works on.

    Its max_ongoing_requests caps the HTTP requests per ingress replica, not what an engine batches (the
    engines refuse what they cannot hold over the token link, and the ingress answers 429), so it is not
    compared with engine.max_batch_size + limits.max_waiting; it must still reach the autoscaling target,
    or Serve's plain-text queue takes the load a replica was meant to carry.
    """
    from gpt2_platform.serve.autoscaling import ENGINE_POLICY_PATH, POLICY_PATH

    num_gpus = (deployment.get("ray_actor_options") or {}).get("num_gpus") or 0
    if num_gpus > 0:
        raise DeployConfigError(
            source,
            f"{field}.ray_actor_options.num_gpus",
            f"is {num_gpus}, but {INGRESS_DEPLOYMENT} never holds a model: set 0 and give the GPUs to "
            f"{ENGINE_DEPLOYMENT}'s ray_actor_options.num_gpus",
        )
    _check_max_ongoing_reaches_target(deployment, field, source, bounds, default=None)
    if bounds is not None and _policy_function(bounds) == ENGINE_POLICY_PATH:
        raise DeployConfigError(
            source,
            f"{field}.autoscaling_config.policy.policy_function",
            f"{ENGINE_POLICY_PATH} reads the sequences engines report, which an ingress has none of: use {POLICY_PATH}",
        )


def _check_engine(deployment: dict[str, Any], field: str, source: str, args: Any, bounds: Any) -> None:
    """GPT2Engine scales on the sequences it reports and takes one Serve call per sequence in its fallback."""
    from gpt2_platform.serve.autoscaling import ENGINE_POLICY_PATH

    capacity = args.engine.max_slots + args.limits.max_waiting
    max_ongoing = deployment.get("max_ongoing_requests")  # left out: the builder's default, above capacity
    if max_ongoing is not None and max_ongoing <= capacity:
        raise DeployConfigError(
            source,
            f"{field}.max_ongoing_requests",
            f"{max_ongoing} must exceed args.engine.max_batch_size + args.limits.max_waiting ({capacity}): "
            "while an ingress has no token link, each sequence is one call, and the engine must see every "
            "sequence it could hold to refuse the rest itself (429 JSON); or leave it out for the builder's default",
        )
    if bounds is None:
        return
    if _policy_function(bounds) != ENGINE_POLICY_PATH:
        raise DeployConfigError(
            source,
            f"{field}.autoscaling_config.policy",
            f"is {_policy_function(bounds)}; set policy: {{policy_function: {ENGINE_POLICY_PATH}}}: sequences "
            "reach engines over token links, not as Serve calls, so any policy on Serve's count reads about no load",
        )
    if bounds.target_ongoing_requests > capacity:
        raise DeployConfigError(
            source,
            f"{field}.autoscaling_config.target_ongoing_requests",
            f"{bounds.target_ongoing_requests:g} sequences per engine is more than one engine holds "
            f"(args.engine.max_batch_size + args.limits.max_waiting = {capacity}), so it could never be reached; "
            "aim below engine.max_batch_size (e.g. 0.75 x)",
        )


def serve_applications(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What must agree between two Serve configs of the same service: each app by name, without `args.model`
    (where the weights live differs between clusters)."""
    apps = {}
    for app in config.get("applications") or []:
        app = copy.deepcopy(app)
        (app.get("args") or {}).pop("model", None)
        app["deployments"] = {deployment.get("name"): deployment for deployment in app.get("deployments") or []}
        apps[app.get("name")] = app
    return apps


def differences(expected: Any, actual: Any, where: str = "applications") -> list[str]:
    """Every path at which `actual` differs from `expected`, as `path: expected X, found Y` lines."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = []
        for key in sorted(set(expected) | set(actual), key=str):
            path = (
                f"{where}[{key}]"
                if where.endswith("applications") or where.endswith("deployments")
                else f"{where}.{key}"
            )
            if key not in actual:
                found.append(f"{path}: missing (expected {expected[key]!r})")
            elif key not in expected:
                found.append(f"{path}: not in the reference (found {actual[key]!r})")
            else:
                found += differences(expected[key], actual[key], path)
        return found
    return [] if expected == actual else [f"{where}: expected {expected!r}, found {actual!r}"]


# --- KubeRay manifests -------------------------------------------------------------------------------------


def validate_kuberay(path: str | Path, serve_reference: str | Path | None = None) -> list[dict[str, Any]]:
    """Validate KubeRay manifests (ray.io/v1 RayCluster, RayService, RayJob; other kinds pass through).

    Token auth on every Ray cluster, rayVersion equal to the installed Ray, worker group bounds, a RayService's
    serveConfigV2 through `validate_serve_config` and, given `serve_reference`, the same applications.
    """
    import ray

    try:
        documents = [document for document in yaml.safe_load_all(Path(path).read_text()) if document]
    except yaml.YAMLError as error:
        raise DeployConfigError(path, "(file)", f"not valid YAML: {error}") from None
    resources = [document for document in documents if document.get("kind") in KUBERAY_KINDS]
    if not resources:
        raise DeployConfigError(path, "kind", f"no {'/'.join(KUBERAY_KINDS)} in this file")
    for resource in resources:
        kind = resource["kind"]
        name = f"{kind} {resource.get('metadata', {}).get('name', '?')}"
        if resource.get("apiVersion") != KUBERAY_API_VERSION:
            raise DeployConfigError(path, f"{name}: apiVersion", f"use {KUBERAY_API_VERSION}, the stable KubeRay API")
        spec = resource.get("spec") or {}
        cluster_field = {"RayCluster": "spec", "RayService": "spec.rayClusterConfig", "RayJob": "spec.rayClusterSpec"}
        cluster = spec if kind == "RayCluster" else spec.get(cluster_field[kind].split(".")[1])
        if cluster is None and not (kind == "RayJob" and spec.get("clusterSelector")):
            raise DeployConfigError(path, f"{name}: {cluster_field[kind]}", "missing; describe the Ray cluster")
        if cluster is not None:
            _check_ray_cluster_spec(cluster, f"{name}: {cluster_field[kind]}", path, ray.__version__)
        if kind == "RayService":
            _check_rayservice(spec, name, path, serve_reference)
        if kind == "RayJob" and not str(spec.get("entrypoint", "")).strip():
            raise DeployConfigError(path, f"{name}: spec.entrypoint", "missing; e.g. python jobs/train.py --config ...")
    return resources


def _check_ray_cluster_spec(cluster: dict[str, Any], field: str, source: str | Path, ray_version: str) -> None:
    if str(cluster.get("rayVersion")) != ray_version:
        raise DeployConfigError(
            source,
            f"{field}.rayVersion",
            f"is {cluster.get('rayVersion')!r}; set it to {ray_version!r}, the Ray this project pins",
        )
    head = cluster.get("headGroupSpec")
    if head is None:
        raise DeployConfigError(source, f"{field}.headGroupSpec", "missing")
    groups = [("headGroupSpec", head)]
    groups += [(f"workerGroupSpecs[{g.get('groupName')}]", g) for g in cluster.get("workerGroupSpecs") or []]
    # KubeRay >= 1.5.1 generates a token Secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN in every Ray container.
    operator_token = (cluster.get("authOptions") or {}).get("mode") == "token"
    for group_field, group in groups:
        if group_field != "headGroupSpec":
            low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
            if not low <= group.get("replicas", low) <= high:
                raise DeployConfigError(
                    source,
                    f"{field}.{group_field}",
                    f"needs minReplicas <= replicas <= maxReplicas (got {low}, {group.get('replicas')}, {high})",
                )
        if operator_token:
            continue
        for container in (group.get("template") or {}).get("spec", {}).get("containers") or []:
            env = {item.get("name"): item for item in container.get("env") or []}
            if (env.get(AUTH_MODE_VAR) or {}).get("value") != "token" or not any(name in env for name in TOKEN_VARS):
                raise DeployConfigError(
                    source,
                    f"{field}.{group_field} container {container.get('name')}",
                    "runs without token auth: set authOptions: {mode: token} on the cluster (KubeRay >= 1.5.1), or "
                    "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret in every Ray container",
                )


def _check_rayservice(spec: dict[str, Any], name: str, source: str | Path, serve_reference: str | Path | None) -> None:
    text = spec.get("serveConfigV2")
    if not isinstance(text, str):
        raise DeployConfigError(source, f"{name}: spec.serveConfigV2", "missing; a Serve config as a YAML string")
    try:
        serve_config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise DeployConfigError(source, f"{name}: spec.serveConfigV2", f"not valid YAML: {error}") from None
    validate_serve_config(serve_config, source=f"{source}: {name}: spec.serveConfigV2")
    if serve_reference is not None:
        reference = load_yaml(serve_reference)
        drift = differences(serve_applications(reference), serve_applications(serve_config))
        if drift:
            raise DeployConfigError(
                source,
                f"{name}: spec.serveConfigV2",
                f"differs from {serve_reference} (args.model aside); make them agree:\n  " + "\n  ".join(drift),
            )


# --- any of the above ---------------------------------------------------------------------------------------


def detect_kind(path: str | Path) -> str:
    """'kuberay', 'cluster' or 'serve', from what the file holds."""
    text = Path(path).read_text()
    if re.search(rf"^apiVersion:\s*{re.escape(KUBERAY_API_VERSION.split('/')[0])}/", text, re.MULTILINE):
        return "kuberay"
    try:
        documents = [document for document in yaml.safe_load_all(text) if document]
    except yaml.YAMLError as error:
        raise DeployConfigError(path, "(file)", f"not valid YAML: {error}") from None
    first = documents[0] if documents and isinstance(documents[0], dict) else {}
    if "provider" in first:
        return "cluster"
    if "applications" in first:
        return "serve"
    if "apiVersion" in first:
        return "kuberay"
    raise DeployConfigError(
        path, "(file)", "neither a cluster config (provider:), a Serve config (applications:) nor KubeRay"
    )


def validate_file(path: str | Path, serve_reference: str | Path | None = None) -> str:
    """Validate whatever deployment file `path` is; return its kind."""
    kind = detect_kind(path)
    if kind == "cluster":
        validate_cluster_config(path)
    elif kind == "serve":
        validate_serve_config(path)
    else:
        validate_kuberay(path, serve_reference=serve_reference)
    return kind
