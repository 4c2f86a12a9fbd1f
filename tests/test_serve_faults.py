"""Serving faults over real Serve and HTTP: the engine's process dies under load, and a burst past every
limit. (A killed ingress replica and a bad `serve deploy` over a running app: tests/test_serve_proxy.py.)

What a client gets in each: JSON in OpenAI's error shape (never Serve's plain text), a Retry-After
where trying again helps, and a stream cut by the fault that ends with an SSE error event and [DONE].
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import test_serve
from test_serve import FAST_DRAIN, wait_until

model_dir = test_serve.model_dir  # the fixture: a tiny model trained to write ASCII, with the byte tokenizer
# serve_port (conftest.py): the session's Serve, which the Serve modules share; each deploys and deletes its apps.


# ---- the engine's process dies under load -------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_process_url(serve_port, model_dir) -> Iterator[str]:
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    args = {"model": str(model_dir), "engine": {"dtype": "fp32", "max_batch_size": 4}}
    # A fast health check, so Serve replaces the engine replica whose process died within seconds.
    engine_options = {"ray_actor_options": {"num_cpus": 0.5}, "health_check_period_s": 1, **FAST_DRAIN}
    app = gpt2_deployment(args, engine_options=engine_options, ray_actor_options={"num_cpus": 0.5}, **FAST_DRAIN)
    serve.run(app, name="faults", route_prefix="/")
    yield f"http://127.0.0.1:{serve_port}"
    serve.delete("faults")


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "server_error" and int(response.headers["Retry-After"]) >= 1


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def replica_logs(replica: str, pid: int) -> str:
    """What the replica `replica` (its unique id) with process id `pid` logged: Serve's log file of it (where a
    call that raised leaves its traceback) and its process's stderr (where this package's lines go)."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    [serve_log] = (logs / "serve").glob(f"replica_*_{replica}.log")
    [stderr] = logs.glob(f"worker-*-{pid}.err")
    return serve_log.read_text() + stderr.read_text()


def test_a_dead_engine_ends_streams_with_an_error_event_and_requests_get_503_until_replaced(engine_process_url):
    long = {"prompt": "a long story", "max_tokens": 200, "ignore_eos": True}

    async def load() -> tuple[dict, float, list[list], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=engine_process_url, timeout=60) as session:
            engine = (await session.get("/v1/engine/stats")).json()
            streaming = [asyncio.Event(), asyncio.Event()]

            async def stream(started: asyncio.Event) -> list:
                events = []
                async with session.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            payload = line[len("data: ") :]
                            events.append(payload if payload == "[DONE]" else json.loads(payload))
                            started.set()
                return events

            streams = [asyncio.create_task(stream(started)) for started in streaming]
            collected = asyncio.create_task(session.post("/v1/completions", json=long))
            # Both streams under way (their 200 sent), the third request still collecting its text.
            await asyncio.wait_for(asyncio.gather(*(started.wait() for started in streaming)), 30)
            os.kill(engine["engine_pid"], signal.SIGKILL)
            killed = time.monotonic()
            cut = await asyncio.wait_for(asyncio.gather(*streams), 30)  # promptly, not at the client's timeout
            in_flight = await collected
            after = await session.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            return engine, killed, cut, in_flight, after

    engine, killed, cut, in_flight, after = asyncio.run(load())
    # The replica notices its engine's exit at once and exits itself, for Serve to replace it at its next
    # health check (one that only failed its checks would wait for several in a row).
    assert wait_until(lambda: not pid_alive(engine["replica_pid"]), timeout_s=5, interval_s=0.05)
    assert time.monotonic() - killed < 3
    messages = [events[-2]["error"]["message"] for events in cut]
    for events in cut:
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "engine" in error["message"], error
    assert_unavailable(in_flight)
    assert_unavailable(after)  # refused at once while no engine answers, not queued behind the restart
    messages += [in_flight.json()["error"]["message"], after.json()["error"]["message"]]
    assert all(message.count("retry the request") == 1 for message in messages), messages

    def served_again() -> bool:
        try:
            response = httpx.post(
                f"{engine_process_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10
            )
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            assert_unavailable(response)  # JSON while it is replaced, never plain text
            assert response.json()["error"]["message"].count("retry the request") == 1, response.text
        return response.status_code == 200

    assert wait_until(served_again, timeout_s=120, interval_s=0.25)
    print(f"served again {time.monotonic() - killed:.1f} s after the kill")
    # One line says why the replica went, not a traceback per call that reached it meanwhile.
    log = replica_logs(engine["replica"], engine["replica_pid"])
    assert log.count("this replica exits") == 1 and "Traceback" not in log, log[-3000:]


def test_a_burst_past_every_limit_gets_json_429s_with_retry_after_never_plain_text(engine_process_url):
    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=engine_process_url, timeout=120, limits=limits) as session:
            # 300 sequences of 120 tokens on 4 slots: several times the 5 s wait budget, however fast the CPU.
            body = {"prompt": "burst", "max_tokens": 120, "ignore_eos": True}
            return await asyncio.gather(*(session.post("/v1/completions", json=body) for _ in range(300)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, sorted(set(statuses))
    for response in responses:
        assert response.headers["content-type"] == "application/json", response.text
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "overloaded" and 1 <= int(response.headers["Retry-After"]) <= 30


# ---- two engines behind one ingress ------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_engines_url(serve_port, model_dir) -> Iterator[str]:
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    # A loaded 2-core CI machine steps slowly enough that a wave's last sequences would wait past the default
    # budget and get 429; this test is about spreading over engines, not admission (test_admission's).
    args = {
        "model": str(model_dir),
        "engine": {"dtype": "fp32", "max_batch_size": 4},
        "limits": {"max_queue_wait_s": 120},
    }
    engine_options = {
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 0.5},
        "health_check_period_s": 1,
        **FAST_DRAIN,
    }
    app = gpt2_deployment(args, engine_options=engine_options, ray_actor_options={"num_cpus": 0.5}, **FAST_DRAIN)
    serve.run(app, name="two-engines", route_prefix="/two")
    yield f"http://127.0.0.1:{serve_port}/two"
    serve.delete("two-engines")


def engine_replicas(app: str) -> dict[str, dict]:
    """Each engine replica's stats, by replica id (Serve routes each call to one of them)."""
    from ray import serve

    handle = serve.get_deployment_handle("GPT2Engine", app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(30):
        stats = handle.stats.remote().result(timeout_s=10)
        seen[stats["replica"]] = stats
    return seen


def test_two_engines_share_an_ingress_s_sequences_and_one_dying_leaves_the_other_serving(two_engines_url):
    body = {"prompt": "a story", "max_tokens": 24, "ignore_eos": True}

    async def wave(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=two_engines_url, timeout=60) as session:
            return await asyncio.gather(*(session.post("/v1/completions", json=body) for _ in range(n)))

    def both_engines_worked() -> bool:  # the ingress finds both (its connect calls) and spreads over them
        responses = asyncio.run(wave(8))
        assert all(r.status_code == 200 for r in responses), [(r.status_code, r.text[:300]) for r in responses]
        replicas = engine_replicas("two-engines")
        return len(replicas) == 2 and all(stats["generated_tokens"] > 0 for stats in replicas.values())

    assert wait_until(both_engines_worked, timeout_s=60, interval_s=1), engine_replicas("two-engines")
    one = next(iter(engine_replicas("two-engines").values()))
    os.kill(one["engine_pid"], signal.SIGKILL)
    time.sleep(1)  # the link closes at once; this is only for the dead engine's replica to notice too

    def served() -> bool:
        return all(r.status_code == 200 for r in asyncio.run(wave(4)))

    # The other engine serves every new request: no 503 window while the dead one is replaced.
    assert served() and served()
