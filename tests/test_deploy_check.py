"""The deployment files pass Ray's and Serve's own schemas and the project's rules; broken copies do not."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpt2_platform.ops import deploy_check
from gpt2_platform.ops.deploy_check import DeployConfigError

REPO = Path(__file__).resolve().parent.parent
CLUSTER_CONFIGS = [REPO / "cluster.yaml", REPO / "deployments" / "cluster-local.yaml"]
SERVE_CONFIGS = [REPO / "deployments" / "gpt2.yaml", REPO / "deployments" / "gpt2-cluster.yaml"]
CLUSTER_SERVE = REPO / "deployments" / "gpt2-cluster.yaml"
KUBERAY = REPO / "deployments" / "kuberay"
KUBERAY_MANIFESTS = sorted(KUBERAY.glob("*.yaml"))
TOKEN_MOUNT = "~/.ray/auth_token"


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rayservice_serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


# --- cluster launcher configs -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_cluster_config_passes_rays_schema_and_has_token_auth_everywhere(path: Path):
    config = deploy_check.validate_cluster_config(path)
    starts = [c for field in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[field]]
    starts = [command for command in starts if "ray start" in command]
    assert len(starts) == 2, starts
    assert all("RAY_AUTH_MODE=token" in command for command in starts)
    assert TOKEN_MOUNT in config["file_mounts"]
    # The cluster Serve config requires an API key: every raylet gets it from a shipped file, never from YAML.
    assert "~/gpt2-platform/api_key" in config["file_mounts"]
    assert all("GPT2_API_KEY=$(cat ~/gpt2-platform/api_key)" in command for command in starts)


def test_aws_cluster_has_a_cpu_head_that_runs_no_work_and_scalable_gpu_workers():
    config = deploy_check.validate_cluster_config(REPO / "cluster.yaml")
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0 and head["max_workers"] == 0
    (worker,) = [node for name, node in node_types.items() if name != config["head_node_type"]]
    assert worker["resources"]["GPU"] >= 1 and worker["min_workers"] == 0 < worker["max_workers"]
    head_start = next(command for command in config["head_start_ray_commands"] if "ray start" in command)
    assert "--num-cpus=0" in head_start and "--metrics-export-port=" in head_start
    assert "RAY_PROMETHEUS_HOST=" in head_start and "RAY_GRAFANA_HOST=" in head_start


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_cluster_config_installs_the_wheel_of_pyprojects_version(path: Path):
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    wheel = f"gpt2_platform-{version}-py3-none-any.whl"
    config = load(path)
    assert config["file_mounts"][f"~/gpt2-platform/{wheel}"] == f"./dist/{wheel}"
    assert any(f"~/gpt2-platform/{wheel}" in command for command in config["setup_commands"])


def broken_cluster_config(tmp_path: Path, edit) -> Path:
    config = load(REPO / "cluster.yaml")
    edit(config)
    return write_yaml(tmp_path / "cluster.yaml", config)


def _worker_start_index(config: dict[str, Any]) -> int:
    return next(i for i, command in enumerate(config["worker_start_ray_commands"]) if "ray start" in command)


@pytest.mark.parametrize("replacement", ["", "RAY_AUTH_MODE=disabled"], ids=["unset", "disabled"])
def test_a_worker_ray_start_without_token_auth_is_refused(tmp_path: Path, replacement: str):
    def edit(config):
        index = _worker_start_index(config)
        commands = config["worker_start_ray_commands"]
        commands[index] = commands[index].replace("RAY_AUTH_MODE=token", replacement)

    path = broken_cluster_config(tmp_path, edit)
    with pytest.raises(DeployConfigError, match=r"worker_start_ray_commands\[1\].*export RAY_AUTH_MODE=token") as error:
        deploy_check.validate_cluster_config(path)
    assert str(path) in str(error.value)


def test_a_ray_start_with_no_token_reaching_the_node_is_refused(tmp_path: Path):
    path = broken_cluster_config(tmp_path, lambda config: config["file_mounts"].pop(TOKEN_MOUNT))
    with pytest.raises(DeployConfigError, match=r"head_start_ray_commands\[1\]: no token reaches this node"):
        deploy_check.validate_cluster_config(path)


@pytest.mark.parametrize("binding", ["--dashboard-host=0.0.0.0", "--dashboard-host 0.0.0.0", ""])
def test_a_head_dashboard_beyond_loopback_is_refused(tmp_path: Path, binding: str):
    def edit(config):
        commands = config["head_start_ray_commands"]
        index = next(i for i, command in enumerate(commands) if "ray start" in command)
        commands[index] = commands[index].replace("--dashboard-host=127.0.0.1", binding)

    path = broken_cluster_config(tmp_path, edit)
    with pytest.raises(DeployConfigError, match=r"head_start_ray_commands\[1\].*--dashboard-host=127.0.0.1"):
        deploy_check.validate_cluster_config(path)


def test_a_field_outside_rays_schema_is_refused(tmp_path: Path):
    path = broken_cluster_config(tmp_path, lambda config: config["available_node_types"]["head"].update(max_worker=1))
    with pytest.raises(DeployConfigError, match=r"available_node_types\.head: fails Ray's cluster schema"):
        deploy_check.validate_cluster_config(path)


# --- Serve configs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.name)
def test_serve_configs_pass_serves_schema_and_ours(path: Path):
    schema = deploy_check.validate_serve_config(path)
    assert [app.import_path for app in schema.applications] == [deploy_check.APP_BUILDER]


def test_local_serve_config_stays_on_localhost():
    assert load(REPO / "deployments" / "gpt2.yaml")["http_options"]["host"] == "127.0.0.1"


def test_cluster_serve_config_requires_an_api_key_and_gives_each_replica_a_gpu():
    from gpt2_platform.serve.schemas import AppArgs, ServeLimits

    config = load(CLUSTER_SERVE)
    (app,) = config["applications"]
    assert config["http_options"]["host"] == "0.0.0.0"
    assert app["args"]["api_key_env"] == "GPT2_API_KEY"
    # The limits are written out, not left to defaults that could change under a running service.
    assert set(app["args"]["limits"]) == set(ServeLimits.model_fields)
    assert AppArgs.model_validate(app["args"]).limits.max_body_bytes <= 1_000_000
    deployments = {deployment["name"]: deployment for deployment in app["deployments"]}
    assert set(deployments) == {"GPT2Server", "GPT2Engine"}
    assert deployments["GPT2Engine"]["ray_actor_options"]["num_gpus"] == 1
    assert deployments["GPT2Server"]["ray_actor_options"]["num_gpus"] == 0
    # More than one ingress replica, so one going down leaves another serving.
    assert deployments["GPT2Server"]["autoscaling_config"]["min_replicas"] >= 2


def broken_serve_config(edit, deployment: str = "GPT2Server") -> dict[str, Any]:
    config = load(CLUSTER_SERVE)
    (app,) = config["applications"]
    edit(app, next(entry for entry in app["deployments"] if entry["name"] == deployment))
    return config


def test_autoscaling_min_above_max_passes_serves_file_schema_but_not_ours():
    from ray.serve.schema import ServeDeploySchema

    config = broken_serve_config(
        lambda app, dep: dep["autoscaling_config"].update(
            min_replicas=dep["autoscaling_config"]["max_replicas"] + 1,
            initial_replicas=dep["autoscaling_config"]["max_replicas"] + 1,
        )
    )
    ServeDeploySchema.model_validate(config)  # Serve's own file schema does not look inside autoscaling_config
    with pytest.raises(DeployConfigError, match=r"deployments\[GPT2Server\]\.autoscaling_config: .*min_replicas"):
        deploy_check.validate_serve_config(config, source="gpt2-cluster.yaml")


@pytest.mark.parametrize(
    "autoscaling, match",
    [
        ({"initial_replicas": 200}, r"initial_replicas"),
        ({"target_ongoing_requests": 0}, r"target_ongoing_requests"),
        ({"target_ongoing_requets": 24}, r"unknown keys \['target_ongoing_requets'\]"),
        ({"target_ongoing_requests": 2000}, r"max_ongoing_requests: 1024 is below autoscaling target_ongoing_requests"),
    ],
)
def test_inconsistent_autoscaling_is_refused(autoscaling: dict[str, Any], match: str):
    config = broken_serve_config(lambda app, dep: dep["autoscaling_config"].update(autoscaling))
    with pytest.raises(DeployConfigError, match=match):
        deploy_check.validate_serve_config(config)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            {"engine": {"max_batch_size": 0}},
            r"args: engine: args\.engine\.max_batch_size must be auto or an integer >= 1, got 0",
        ),
        ({"engine": {"dtype": "fp8"}}, r"args: engine: args\.engine\.dtype: Input should be 'auto'"),
        ({"max_batch_size": 8}, r"args\.max_batch_size moved under `engine:`"),
        ({"engine_process": True}, r"args\.engine_process is gone: the engine now always runs in its own deployment"),
        ({"max_batch_sise": 8}, r"args: max_batch_sise: Extra inputs are not permitted"),
        ({"api_key_env": None}, r"args\.api_key_env: Serve listens on '0\.0\.0\.0'"),
    ],
)
def test_bad_app_args_are_refused(args: dict[str, Any], match: str):
    config = broken_serve_config(lambda app, dep: app["args"].update(args))
    with pytest.raises(DeployConfigError, match=match):
        deploy_check.validate_serve_config(config)


def test_the_checks_deployment_names_are_the_apps():
    from gpt2_platform.serve.app import GPT2Server
    from gpt2_platform.serve.engine_deployment import GPT2Engine

    assert (deploy_check.INGRESS_DEPLOYMENT, deploy_check.ENGINE_DEPLOYMENT) == (GPT2Server.name, GPT2Engine.name)


@pytest.mark.parametrize(
    "policy",
    [None, {"policy_function": "gpt2_platform.serve.autoscaling:working_requests_policy"}],
    ids=["serves-default", "the-ingress-policy"],
)
def test_an_engine_scaled_on_anything_but_its_sequences_is_refused(policy: dict[str, Any] | None):
    def edit(app, engine):
        if policy is None:
            engine["autoscaling_config"].pop("policy")
        else:
            engine["autoscaling_config"]["policy"] = policy

    config = broken_serve_config(edit, deployment="GPT2Engine")
    with pytest.raises(
        DeployConfigError,
        match=r"deployments\[GPT2Engine\]\.autoscaling_config\.policy: .*gpt2_platform\.serve\.autoscaling:sequences_policy",
    ):
        deploy_check.validate_serve_config(config)


def test_an_engine_without_autoscaling_needs_no_policy():
    def edit(app, engine):
        engine.pop("autoscaling_config")
        engine["num_replicas"] = 2

    deploy_check.validate_serve_config(broken_serve_config(edit, deployment="GPT2Engine"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda engine: engine.update(max_ongoing_requests=1280),
            r"GPT2Engine\]\.max_ongoing_requests: 1280 must exceed args\.engine\.max_batch_size \+ args\.limits\.max_waiting \(1280\)",
        ),
        (
            lambda engine: engine["autoscaling_config"].update(target_ongoing_requests=1281),
            r"GPT2Engine\]\.autoscaling_config\.target_ongoing_requests: 1281 sequences per engine is more than one engine holds",
        ),
    ],
    ids=["max-ongoing-below-capacity", "target-beyond-capacity"],
)
def test_an_engine_that_could_not_hold_or_reach_its_sequences_is_refused(edit, match: str):
    config = broken_serve_config(lambda app, engine: edit(engine), deployment="GPT2Engine")
    with pytest.raises(DeployConfigError, match=match):
        deploy_check.validate_serve_config(config)


def test_an_ingress_asking_for_a_gpu_is_refused():
    config = broken_serve_config(lambda app, server: server["ray_actor_options"].update(num_gpus=1))
    with pytest.raises(
        DeployConfigError, match=r"deployments\[GPT2Server\]\.ray_actor_options\.num_gpus: is 1, .*GPT2Engine"
    ):
        deploy_check.validate_serve_config(config)


def test_an_ingress_scaled_on_engine_sequences_is_refused():
    def edit(app, server):
        server["autoscaling_config"]["policy"] = {"policy_function": "gpt2_platform.serve.autoscaling:sequences_policy"}

    with pytest.raises(
        DeployConfigError, match=r"GPT2Server\]\.autoscaling_config\.policy\.policy_function: .*working_requests_policy"
    ):
        deploy_check.validate_serve_config(broken_serve_config(edit))


def test_an_unknown_deployment_name_is_refused():
    config = broken_serve_config(lambda app, server: server.update(name="GPT2Servr"))
    with pytest.raises(
        DeployConfigError, match=r"deployments\[GPT2Servr\]: unknown deployment 'GPT2Servr': .*GPT2Server .*GPT2Engine"
    ):
        deploy_check.validate_serve_config(config)


def test_no_api_key_is_fine_on_localhost():
    def edit(app, deployment):
        app["args"]["api_key_env"] = None

    config = broken_serve_config(edit)
    config["http_options"]["host"] = "127.0.0.1"
    deploy_check.validate_serve_config(config)


# --- KubeRay manifests --------------------------------------------------------------------------------------


def test_kuberay_manifests_are_the_three_kinds_on_the_stable_api():
    kinds = {}
    for path in KUBERAY_MANIFESTS:
        for resource in deploy_check.validate_kuberay(path, serve_reference=CLUSTER_SERVE):
            kinds[resource["kind"]] = resource
    assert set(kinds) == {"RayCluster", "RayService", "RayJob"}
    assert "jobs/train.py --config jobs/configs/gpt2.yaml" in kinds["RayJob"]["spec"]["entrypoint"]
    assert (REPO / "jobs" / "configs" / "gpt2.yaml").is_file()
    for cluster in (kinds["RayCluster"]["spec"], kinds["RayService"]["spec"]["rayClusterConfig"]):
        assert cluster["authOptions"] == {"mode": "token"}


def test_rayservice_carries_the_cluster_serve_config():
    (service,) = deploy_check.validate_kuberay(KUBERAY / "rayservice.yaml")
    reference, carried = load(CLUSTER_SERVE), rayservice_serve_config(service)
    drift = deploy_check.differences(
        deploy_check.serve_applications(reference), deploy_check.serve_applications(carried)
    )
    assert not drift, f"{KUBERAY / 'rayservice.yaml'} serveConfigV2 differs from {CLUSTER_SERVE}:\n" + "\n".join(drift)
    assert carried["http_options"] == reference["http_options"]


def drifted_rayservice(tmp_path: Path, edit) -> Path:
    (service,) = [doc for doc in yaml.safe_load_all((KUBERAY / "rayservice.yaml").read_text()) if doc]
    serve_config = rayservice_serve_config(service)
    edit(serve_config["applications"][0])
    service["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config, sort_keys=False)
    return write_yaml(tmp_path / "rayservice.yaml", service)


def test_rayservice_drifting_from_the_cluster_serve_config_is_refused_with_what_differs(tmp_path: Path):
    def edit(app):
        app["deployments"][0]["autoscaling_config"]["max_replicas"] = 48
        app["args"]["limits"]["max_prompts"] = 8

    path = drifted_rayservice(tmp_path, edit)
    with pytest.raises(DeployConfigError) as error:
        deploy_check.validate_kuberay(path, serve_reference=CLUSTER_SERVE)
    message = str(error.value)
    assert (
        "applications[gpt2].deployments[GPT2Server].autoscaling_config.max_replicas: expected 96, found 48" in message
    )
    assert "applications[gpt2].args.limits.max_prompts: expected 32, found 8" in message


def test_rayservice_may_read_its_model_from_elsewhere(tmp_path: Path):
    path = drifted_rayservice(tmp_path, lambda app: app["args"].update(model="openai-community/gpt2"))
    deploy_check.validate_kuberay(path, serve_reference=CLUSTER_SERVE)


def test_an_args_key_added_to_both_configs_needs_no_change_to_the_comparison():
    reference = load(CLUSTER_SERVE)
    carried = copy.deepcopy(reference)
    for config in (reference, carried):
        config["applications"][0]["args"]["moderation"] = {"enabled": True}
    assert not deploy_check.differences(
        deploy_check.serve_applications(reference), deploy_check.serve_applications(carried)
    )
    carried["applications"][0]["args"]["moderation"]["enabled"] = False
    assert deploy_check.differences(
        deploy_check.serve_applications(reference), deploy_check.serve_applications(carried)
    ) == ["applications[gpt2].args.moderation.enabled: expected True, found False"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda spec: spec.pop("authOptions"), r"container ray-head.*runs without token auth"),
        (lambda spec: spec.update(rayVersion="2.52.0"), r"spec\.rayVersion: is '2\.52\.0'; set it to '2\.60\.0'"),
        (lambda spec: spec["workerGroupSpecs"][0].update(minReplicas=5), r"workerGroupSpecs\[gpu\]: needs minReplicas"),
    ],
    ids=["no-token-auth", "other-ray", "replica-bounds"],
)
def test_broken_raycluster_is_refused(tmp_path: Path, edit, match: str):
    documents = [doc for doc in yaml.safe_load_all((KUBERAY / "raycluster.yaml").read_text()) if doc]
    (cluster,) = [doc for doc in documents if doc["kind"] == "RayCluster"]
    edit(cluster["spec"])
    path = tmp_path / "raycluster.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    with pytest.raises(DeployConfigError, match=match):
        deploy_check.validate_kuberay(path)


def test_manual_token_env_from_a_secret_is_accepted(tmp_path: Path):
    (cluster,) = [
        doc
        for doc in yaml.safe_load_all((KUBERAY / "raycluster.yaml").read_text())
        if doc and doc["kind"] == "RayCluster"
    ]
    spec = cluster["spec"]
    spec.pop("authOptions")
    token_env = [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ray-token", "key": "auth_token"}}},
    ]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            container["env"] = [*container.get("env", []), *token_env]
    deploy_check.validate_kuberay(write_yaml(tmp_path / "raycluster.yaml", cluster))


# --- the command line ---------------------------------------------------------------------------------------


def run_check_deploy(*paths: Path, capsys) -> tuple[int, str]:
    sys.path.insert(0, str(REPO / "jobs"))
    try:
        import check_deploy
    finally:
        sys.path.remove(str(REPO / "jobs"))
    code = check_deploy.main([str(path) for path in paths])
    return code, capsys.readouterr().out


def test_cli_passes_every_deployment_file_of_the_repository(capsys):
    paths = [*CLUSTER_CONFIGS, *SERVE_CONFIGS, *KUBERAY_MANIFESTS]
    code, out = run_check_deploy(*paths, capsys=capsys)
    assert code == 0, out
    assert out.count("OK ") == len(paths), out


def test_cli_reports_each_bad_file_and_exits_2(tmp_path: Path, capsys):
    bad = write_yaml(
        tmp_path / "serve.yaml", broken_serve_config(lambda app, dep: app["args"].update(api_key_env=None))
    )
    code, out = run_check_deploy(REPO / "deployments" / "gpt2.yaml", bad, capsys=capsys)
    assert code == 2
    assert f"OK {REPO / 'deployments' / 'gpt2.yaml'} (serve)" in out
    assert f"error: {bad}: applications[gpt2].args.api_key_env:" in out
