"""The Grafana dashboard queries only metrics the platform actually exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpt2_platform.monitoring.exporter import GPU_TAG_KEYS
from gpt2_platform.monitoring.exporter import METRIC_NAMES as GPU_METRICS
from gpt2_platform.train.metrics import GAUGES as TRAIN_GAUGES

DASHBOARD = Path(__file__).resolve().parent.parent / "deployments" / "grafana" / "gpt2-platform.json"


def serve_metric_names(ray_cluster) -> set[str]:
    from gpt2_platform.serve.metrics import ServeMetrics

    metrics = ServeMetrics("m")
    return {value._name for value in vars(metrics).values() if hasattr(value, "_name")}


def exported(names: set[str]) -> set[str]:
    """Ray prefixes custom metrics with ray_; counters gain _total and histograms _bucket/_sum/_count."""
    return {f"ray_{name}{suffix}" for name in names for suffix in ("", "_total", "_bucket", "_sum", "_count")}


def test_every_panel_query_names_an_exported_metric(ray_cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for q in queries for name in re.findall(r"\bray_gpt2_\w+", q)}
    known = exported({*GPU_METRICS, *(name for name, _ in TRAIN_GAUGES.values()), *serve_metric_names(ray_cluster)})
    assert used, "the dashboard has no queries"
    assert used <= known, f"queries for metrics nobody exports: {sorted(used - known)}"
    # Every family has a panel: GPUs, training and serving.
    assert {n.split("_")[2] for n in used} == {"gpu", "train", "serve"}


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p.get("title", ""), t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_multi_valued_variables_are_matched_as_regexes_in_every_panel():
    """Grafana expands a variable with several values (or All) to `a|b` or `.*`: an exact `=` match of that
    finds no series, so the panel stays empty unless exactly one value is chosen."""
    dashboard = json.loads(DASHBOARD.read_text())
    multi_valued = {
        v["name"]
        for v in dashboard["templating"]["list"]
        if v["type"] == "query" and (v.get("multi") or v.get("includeAll"))
    }
    assert multi_valued >= {"node_id", "run"}
    matcher = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
    checked = 0
    for title, query in panel_queries(dashboard):
        for label, operator, value in matcher.findall(query):
            for name in multi_valued & set(re.findall(r"\$\{?(\w+)", value)):
                assert operator in ("=~", "!~"), f'panel {title!r}: {label}{operator}"{value}" needs =~ for ${name}'
                checked += 1
        # The GPU panels follow the node selection, the training panels the run selection.
        if "ray_gpt2_gpu_" in query:
            assert 'node_id=~"$node_id"' in query, f"panel {title!r} ignores the node variable: {query}"
        if "ray_gpt2_train_" in query:
            assert 'run=~"$run"' in query, f"panel {title!r} ignores the run variable: {query}"
    assert checked >= 14, checked


def test_the_node_filter_lists_each_ray_node_and_legends_show_its_address():
    """Several Ray nodes on one host share its address (the `node` tag): the filter goes by Ray node id, which
    tests/test_multinode_monitor.py checks takes one value per node of a real cluster."""
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "node_id"]
    assert variable["query"] == "label_values(ray_gpt2_gpu_utilization_percent, node_id)"
    assert {"node", "node_id"} <= set(GPU_TAG_KEYS)
    gpu_targets = [t for p in dashboard["panels"] for t in p.get("targets", []) if "ray_gpt2_gpu_" in t["expr"]]
    assert gpu_targets
    for target in gpu_targets:
        assert target["legendFormat"].startswith("{{node}} {{node_id}} "), target
