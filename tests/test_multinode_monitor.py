"""GPU monitoring across nodes (issue 39): on a multi-node Ray on this machine (`ray.cluster_utils.Cluster`,
as Ray's own tests build one), the real `jobs/monitor.py start` puts an exporter on each node, and its keeper
puts one on a node that joins afterwards within its check period; `status --json` lists every node, each
sampled by its exporter; `stop` leaves no exporter and no keeper.

This machine has no GPU: each node's environment names a stand-in NVML (`GPT2_PLATFORM_NVML`, read by
monitoring/nvml.py) with two fake GPUs, so every exporter exports GPU metrics. Scraping each node's Ray
metrics endpoint shows that the Grafana dashboard's node filter takes one value per Ray node, where the
nodes' address (the `node` tag) is one value for all of them.

The cluster runs in a driver subprocess of its own (tests/helpers_multinode.py), which the test checks leaves
no process behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers_multinode import run_driver

pytestmark = pytest.mark.slow

MARKER_VAR = "GPT2_PLATFORM_TEST_MULTINODE_MONITOR"
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
DASHBOARD = REPO_ROOT / "deployments" / "grafana" / "gpt2-platform.json"
# The keeper's check period (`--node-check-period-s`), short for the test.
NODE_CHECK_PERIOD_S = 1.0

# The driver: a head and one worker node, without CPUs (nothing here needs one: the exporters and the keeper
# ask for none, and no worker is started ahead for them), each with FakeNVML in its environment; then the
# monitor's commands as subprocesses, as an operator runs them, with a second worker node added after `start`.
DRIVER = """
import json, os, subprocess, sys, time, urllib.request

import ray
from ray.cluster_utils import Cluster

from gpt2_platform.monitoring import exporter
from gpt2_platform.monitoring.nvml import NVML_STAND_IN_VAR

monitor_script, tests_dir, metric, period_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
# The raylet's environment reaches the workers it starts: the exporters import FakeNVML from tests/.
node_env = {
    NVML_STAND_IN_VAR: "test_monitoring:FakeNVML",
    "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
}
cluster = Cluster(
    initialize_head=True,
    head_node_args={
        "num_cpus": 0,
        "include_dashboard": False,
        "env_vars": node_env,
        # Metrics reach each node's endpoint every second, not every ten.
        "_system_config": {"metrics_report_interval_ms": 1000},
    },
)
cluster.add_node(num_cpus=0, env_vars=node_env)
cluster.wait_for_nodes()
ray.init(address=cluster.address)
monitor_env = dict(os.environ, RAY_ADDRESS=cluster.address)
result = {}


def monitor(*arguments):
    done = subprocess.run(
        [sys.executable, monitor_script, *arguments], env=monitor_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def monitoring_actors():
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == exporter.NAMESPACE
    )


def wait_for(condition, timeout_s, poll_s=0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return value


try:
    started = time.monotonic()
    result["start_out"] = monitor("start", "--interval-s", "1", "--node-check-period-s", str(period_s))
    result["start_s"] = time.monotonic() - started
    result["after_start"] = monitoring_actors()

    new_node = cluster.add_node(num_cpus=0, env_vars=node_env)  # returns once the node is alive in the GCS
    joined = time.monotonic()
    name = exporter.actor_name(new_node.node_id)
    wait_for(lambda: name in monitoring_actors(), timeout_s=30)
    result["registered_s"] = time.monotonic() - joined
    first = ray.get(ray.get_actor(name, namespace=exporter.NAMESPACE).sample.remote(), timeout=60)
    result["sampling_s"] = time.monotonic() - joined
    result["new_node"] = {"id": new_node.node_id, "first_sample_node_id": first.node_id, "gpus": len(first.gpus)}

    result["status"] = json.loads(monitor("status", "--json"))
    nodes = [node for node in ray.nodes() if node["Alive"]]
    result["node_ids"] = [node["NodeID"] for node in nodes]

    def scrape():
        lines = {}
        for node in nodes:
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            lines[node["NodeID"]] = [line for line in text.splitlines() if line.startswith(metric + "{")]
        return lines if all(lines.values()) else None

    result["metric_lines"] = wait_for(scrape, timeout_s=30, poll_s=0.5) or scrape() or {}

    result["stop_out"] = monitor("stop")
    # The keeper's name goes when its actor is dead: none left means no exporter can come back either.
    wait_for(lambda: not monitoring_actors(), timeout_s=10)
    result["after_stop"] = monitoring_actors()
finally:
    ray.shutdown()
    cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


def filter_label() -> tuple[str, str]:
    """(metric, label) of the dashboard's node filter: its variable's `label_values(metric, label)`."""
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v.get("label") == "Node"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]).groups()
    return metric, label


def label_values(lines: list[str], label: str) -> set[str]:
    return {value for line in lines for value in re.findall(rf'[{{,]{label}="([^"]*)"', line)}


def test_exporters_on_every_node_including_one_that_joins_and_one_filter_value_per_node():
    metric, label = filter_label()
    run = run_driver(
        DRIVER,
        [str(REPO_ROOT / "jobs" / "monitor.py"), str(TESTS_DIR), metric, str(NODE_CHECK_PERIOD_S)],
        MARKER_VAR,
        timeout_s=180,
    )
    assert run.returncode == 0, run.log[-6000:]
    assert not run.survivors, f"Ray processes survived the test: {run.survivors}"
    result = run.result()
    print(json.dumps({key: value for key, value in result.items() if key in ("start_s", "registered_s", "sampling_s")}))

    assert "GPU exporters running on 2 node(s)" in result["start_out"], result["start_out"]
    assert f"within {NODE_CHECK_PERIOD_S:g} s" in result["start_out"]
    assert len(result["after_start"]) == 3, result["after_start"]  # two exporters and the keeper

    # The node that joined: its exporter registered within one check period (plus the check's own calls on a
    # loaded machine), then sampled its fake GPUs.
    assert result["registered_s"] < NODE_CHECK_PERIOD_S + 1.0, result["registered_s"]
    new_node = result["new_node"]
    assert new_node["first_sample_node_id"] == new_node["id"] and new_node["gpus"] == 2

    node_ids = set(result["node_ids"])
    assert len(node_ids) == 3 and new_node["id"] in node_ids
    status = result["status"]
    assert sorted(sample["node_id"] for sample in status) == sorted(node_ids)
    assert all(sample["from_exporter"] and sample["available"] and len(sample["gpus"]) == 2 for sample in status)

    # Each node's endpoint holds its own exporter's points; the filter's label takes one value per Ray node,
    # where the address (the old filter's label) is one value for all three.
    lines = result["metric_lines"]
    assert set(lines) == node_ids and all(lines.values()), lines
    for node_id, node_lines in lines.items():
        assert label_values(node_lines, label) == {node_id}
    all_lines = [line for node_lines in lines.values() for line in node_lines]
    assert label_values(all_lines, label) == node_ids
    assert len(label_values(all_lines, "node")) == 1

    assert result["stop_out"].startswith("stopped the exporter keeper; stopped 3 GPU exporter(s)"), result["stop_out"]
    assert result["after_stop"] == []
