"""Serving across nodes survives losing one (issue 39): a multi-node Ray on this machine
(`ray.cluster_utils.Cluster`, as Ray's own tests build one) with an HTTP proxy and an ingress replica on
every node and an engine replica on each of two worker nodes; one engine's node removed under load, then a
node added back.

What a client sees: the streams on the lost engine end with an error event within seconds, the others
complete, and no new request fails, before the loss, across it or after; Serve puts an engine (and an
ingress) on the node that joins, and the ingress sends it sequences.

Each node's proxy binds a port of its own (`RAY_SERVE_WORKER_PROXY_HTTP_PORT` in the node's environment:
on one machine they would share one through SO_REUSEPORT, and a test could not tell which answered). The
cluster runs in a driver subprocess (tests/helpers_multinode.py), which the test checks leaves no process
behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpt2_platform import checkpoint
from gpt2_platform.model import GPT2, preset
from gpt2_platform.ops.local_cluster import free_ports
from gpt2_platform.tokenizer import byte_tokenizer
from helpers_multinode import run_driver

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

MARKER_VAR = "GPT2_PLATFORM_TEST_MULTINODE_SERVE"
STREAMS = 8

# The driver. The head holds Serve's controller, a proxy and an ingress replica; each worker node a proxy,
# an ingress replica and an engine replica (one per node: `max_replicas_per_node`, and the `engine_slot`
# resource only workers have). Load goes to the head's proxy, which routes to its own node's ingress.
DRIVER = """
import asyncio, json, sys, threading, time

import httpx
import ray
from ray import serve
from ray._private import state
from ray.cluster_utils import Cluster

from gpt2_platform.serve.app import gpt2_deployment

model, streams, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ports = [int(port) for port in sys.argv[4].split(",")]
head_port, worker_ports = ports[0], iter(ports[1:])
cluster = Cluster(
    initialize_head=True,
    head_node_args={
        "num_cpus": 1,
        "include_dashboard": False,
        # Declare a lost node dead in about a second, not Ray's default of about fifteen.
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 5},
    },
)
worker_port = {}


def add_worker():
    port = next(worker_ports)
    node = cluster.add_node(
        num_cpus=2, resources={"engine_slot": 1}, env_vars={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(port)}
    )
    worker_port[node.node_id] = port
    return node


workers = [add_worker(), add_worker()]
cluster.wait_for_nodes()
ray.init(address=cluster.address)
result = {}
FAST = {"graceful_shutdown_wait_loop_s": 0.1, "health_check_period_s": 1}


def replicas(name):
    # The GCS's own table: the state API goes through the dashboard, which is off here.
    return {
        a["ActorID"]: a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["ActorClassName"].endswith(":" + name) and a["State"] == "ALIVE"
    }


def wait_for(what, condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(0.1)


def post(port, body, timeout=60):
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout)


def engine_tokens():
    # Each engine replica's generated tokens, by node: Serve routes each call to one of them at random.
    handle = serve.get_deployment_handle("GPT2Engine", app_name="multinode")
    by_node, engines = {}, replicas("GPT2Engine")
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=10)
        by_node[stats["node_id"]] = stats["generated_tokens"]
        if set(by_node) >= set(engines.values()):
            break
    return by_node


try:
    started = time.monotonic()
    serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": head_port})
    args = {"model": model, "engine": {"dtype": "fp32", "max_batch_size": 8}, "limits": {"max_queue_wait_s": 60, "max_tokens_cap": 2000}}
    engine_options = {
        "num_replicas": 2,
        "max_replicas_per_node": 1,
        "ray_actor_options": {"num_cpus": 1, "resources": {"engine_slot": 1}},
        **FAST,
    }
    ingress = {"num_replicas": 3, "max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.25}, **FAST}
    serve.run(gpt2_deployment(args, engine_options=engine_options, **ingress), name="multinode", route_prefix="/")
    result["deployed_s"] = time.monotonic() - started
    result["engine_nodes"] = len(set(replicas("GPT2Engine").values()))
    result["ingress_nodes"] = len(set(replicas("GPT2Server").values()))
    short = {"prompt": "once upon a time", "max_tokens": 8}
    result["proxies_answering"] = sorted(
        port for port in [head_port, *worker_port.values()] if post(port, short).status_code == 200
    )
    # Both engines take the head ingress's sequences (its links come up within seconds of the deploy).
    def both_engines_generated():
        for response in [post(head_port, short) for _ in range(8)]:
            assert response.status_code == 200, response.text
        return len([n for n in engine_tokens().values() if n > 0]) == 2

    wait_for("sequences on both engines", both_engines_generated, 60)

    def ingress_links():
        stats = httpx.get(f"http://127.0.0.1:{head_port}/v1/engine/stats", timeout=10).json()["ingress"]
        result.setdefault("ingress_links_seen", []).append((stats["replica"], stats["links"]))
        return stats["links"] == 2

    # The ingress the load goes through has a link to each engine before the load starts.
    wait_for("the ingress linked to both engines", ingress_links, 60)
    result["linked_s"] = time.monotonic() - started

    long = {"prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    outcomes, lost = [], {}

    async def load():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{head_port}", timeout=120) as session:
            started = [asyncio.Event() for _ in range(streams)]

            async def stream(first):
                events = []
                async with session.stream("POST", "/v1/completions", json=long) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            payload = line[len("data: "):]
                            events.append(payload if payload == "[DONE]" else json.loads(payload))
                            first.set()
                ended = time.monotonic()
                error = next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)
                finish = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
                return {
                    "ended_after_loss_s": ended - lost["at"] if "at" in lost else None,
                    "error": error,
                    "finish": next((f for f in finish if f), None),
                    "done": events[-1] == "[DONE]" if events else False,
                }

            # New requests keep coming, one after another, from before the loss to well after it.
            new = []

            async def new_requests():
                while "at" not in lost or time.monotonic() - lost["at"] < 5:
                    sent = time.monotonic()
                    response = await session.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
                    # When it was sent, from the loss (negative: before it).
                    sent_s = sent - lost["at"] if "at" in lost else -1.0
                    new.append((sent_s, response.status_code, response.text[:200] if response.status_code != 200 else ""))

            tasks = [asyncio.create_task(stream(first)) for first in started]
            steady = asyncio.create_task(new_requests())
            await asyncio.wait_for(asyncio.gather(*(first.wait() for first in started)), 60)
            victim = next(w for w in workers if w.node_id in set(replicas("GPT2Engine").values()))
            lost["at"] = time.monotonic()
            cluster.remove_node(victim, allow_graceful=False)
            lost["removed_s"] = time.monotonic() - lost["at"]
            lost["node"] = victim.node_id
            outcomes.extend(await asyncio.wait_for(asyncio.gather(*tasks), 90))
            await steady
            return new

    new = asyncio.run(load())
    result["streams"] = outcomes
    result["removal_took_s"] = lost["removed_s"]
    result["new_requests"] = len(new)
    result["new_requests_after_loss"] = sum(1 for sent_s, _, _ in new if sent_s >= 0)
    result["new_failed"] = [entry for entry in new if entry[1] != 200]
    result["engines_left"] = len(replicas("GPT2Engine"))

    survivor = next(w for w in workers if w.node_id != lost["node"])
    result["survivor_proxy_status"] = post(worker_port[survivor.node_id], short).status_code

    # A node joins: Serve starts the missing engine and ingress replicas there, and its proxy.
    joined_at = time.monotonic()
    joined = add_worker()
    wait_for("an engine on the new node", lambda: joined.node_id in set(replicas("GPT2Engine").values()), 120)
    result["engine_back_s"] = time.monotonic() - joined_at
    before = engine_tokens().get(joined.node_id, 0)

    def new_engine_serves():
        for response in [post(head_port, short) for _ in range(8)]:
            assert response.status_code == 200, response.text
        return engine_tokens().get(joined.node_id, 0) > before

    wait_for("sequences on the new node's engine", new_engine_serves, 60)
    result["new_engine_serving_s"] = time.monotonic() - joined_at
    wait_for("an ingress on the new node", lambda: joined.node_id in set(replicas("GPT2Server").values()), 60)
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline:
        try:
            status = post(worker_port[joined.node_id], short, timeout=10).status_code
        except httpx.HTTPError:
            status = None
        if status == 200:
            break
        time.sleep(0.25)
    result["joined_proxy_status"] = status
    result["total_s"] = time.monotonic() - started
finally:
    print("RESULT " + json.dumps(result), flush=True)  # what it got to, should it fail
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A context long enough for streams that outlast the node's removal on any CPU.
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("multinode-serve") / "model"
    model = GPT2(preset("tiny", n_positions=2048))
    return checkpoint.save_pretrained(model, directory, extra=lambda d: byte_tokenizer().save_pretrained(d))


def test_losing_an_engine_s_node_under_load_fails_no_new_request_and_serve_refills_a_joining_node(
    model_dir: Path,
):
    ports = free_ports(4)  # the head's proxy, two workers' and the joining node's
    args = [str(model_dir), str(STREAMS), "1500", ",".join(map(str, ports))]
    run = run_driver(DRIVER, args, MARKER_VAR, timeout_s=300)
    assert run.returncode == 0, run.log[-6000:]
    assert not run.survivors, f"Ray processes survived the test: {run.survivors}"
    result = run.result()
    print(json.dumps(result))

    assert result["engine_nodes"] == 2 and result["ingress_nodes"] == 3, result
    assert result["proxies_answering"] == sorted(ports[:3]), "every node's proxy should answer"

    streams = result["streams"]
    cut = [s for s in streams if s["error"] is not None]
    completed = [s for s in streams if s["error"] is None]
    assert cut, "the lost engine's streams should end with an error event"
    assert completed, "the surviving engine's streams should complete"
    for stream in streams:
        assert stream["done"], stream  # every stream, cut or not, ends with [DONE]
    for stream in cut:
        assert stream["error"]["type"] == "server_error" and "engine" in stream["error"]["message"], stream
        assert stream["ended_after_loss_s"] < 30, stream  # no hung stream
    for stream in completed:
        assert stream["finish"] == "length", stream

    assert result["new_requests_after_loss"] > 0
    assert result["new_failed"] == [], "no new request may fail across the loss"
    assert result["survivor_proxy_status"] == 200
    assert result["engines_left"] == 1
    assert result["joined_proxy_status"] == 200, "the joining node's proxy should serve"
