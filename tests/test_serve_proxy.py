"""A real `ray start --head` whose Serve proxy runs our middleware (serve/proxy.py), driven by the
`serve deploy` CLI as an operator would: what clients get when the replica holding their request
dies, when a path has no app, and when a config that cannot start is deployed over a running app.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

import test_serve
from conftest import HEAD_ENV, free_port
from ray_head import RayHead
from test_serve import wait_until

model_dir = test_serve.model_dir  # the fixture: a tiny model trained to write ASCII, with the byte tokenizer
API_KEY_ENV = "GPT2_PROXY_TEST_KEY"  # set to key-1 on the head (conftest.HEAD_ENV)
HEADERS = {"Authorization": f"Bearer {HEAD_ENV[API_KEY_ENV]}"}


@pytest.fixture(scope="module")
def head(ray_head: RayHead) -> RayHead:
    # The session's `ray start --head` (conftest.py), which tests/test_job_submit.py uses too: its node's
    # environment has the proxy's callback (as an operator exports it before `ray start`: the proxy reads it
    # when it starts) and the key (where the replicas, and the app builder, read it). Stopped after this
    # module, failing its last test if any of its processes outlived it.
    return ray_head


def _config(port: int, model_dir: Path, api_key_env: str) -> dict:
    args = {"model": str(model_dir), "engine": {"dtype": "fp32", "max_batch_size": 2}, "api_key_env": api_key_env}
    # Long sequences queue on the 2 slots of a loaded CPU for longer than the default wait budget: these tests
    # are about the proxy, not admission (test_serve.py has those).
    args["limits"] = {"max_queue_wait_s": 120}
    # Two ingress replicas, so one can die while the other serves; one engine behind both (all on the head's
    # 2 CPUs).
    ingress = {
        "name": "GPT2Server",
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 0.5},
        "health_check_period_s": 1,
    }
    engine = {"name": "GPT2Engine", "ray_actor_options": {"num_cpus": 1}}
    application = {
        "name": "gpt2",
        "route_prefix": "/gpt2",
        "import_path": "gpt2_platform.serve.app:build_app",
        "args": args,
        "deployments": [ingress, engine],
    }
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [application]}


def serve_deploy(head: RayHead, config: dict, tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    done = _serve_cli(head, "deploy", str(path), "--address", head.dashboard_url)
    assert done.returncode == 0, done.stdout[-3000:]


def _serve_cli(head: RayHead, *args: str):
    import subprocess

    from ray_head import VENV_BIN

    return subprocess.run(
        [str(VENV_BIN / "serve"), *args], env=head.client_env(), capture_output=True, text=True, timeout=120
    )


def app_status(head: RayHead) -> dict:
    """The app's status from the dashboard's Serve API (what `serve status` prints, without its start-up)."""
    status, body = head.get("/api/serve/applications/", token=head.token)
    assert status == 200, body
    return json.loads(body).get("applications", {}).get("gpt2", {})


@pytest.fixture(scope="module")
def url(head: RayHead, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    port = free_port()
    serve_deploy(head, _config(port, model_dir, API_KEY_ENV), tmp_path_factory.mktemp("deploy"))
    base = f"http://127.0.0.1:{port}/gpt2"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/v1/models", headers=HEADERS, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(up, timeout_s=180, interval_s=0.25), app_status(head)
    return base


def test_a_path_no_app_serves_gets_openai_json_from_the_proxy(url):
    response = httpx.get(url.rsplit("/gpt2", 1)[0] + "/nowhere", timeout=10)
    assert response.status_code == 404 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["message"]


def assert_replica_failed(response: httpx.Response) -> None:
    assert response.headers["content-type"] == "application/json", response.text
    assert response.status_code == 503 and response.json()["error"]["code"] == "replica_failed", response.text
    assert int(response.headers["Retry-After"]) >= 1


def test_a_killed_ingress_replica_ends_its_streams_with_an_error_event_while_the_other_serves_on(url):
    long = {"prompt": "a long story", "max_tokens": 240, "ignore_eos": True}

    async def cut() -> tuple[list[list], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as session:
            # Both ingress replicas answering first: a replica the proxy has not yet heard of takes no stream,
            # and the one killed would then have had them all (seen on a loaded machine).
            pids: set[int] = set()
            deadline = time.monotonic() + 60
            while len(pids) < 2 and time.monotonic() < deadline:
                pids.add((await session.get("/v1/engine/stats")).json()["ingress"]["pid"])
            assert len(pids) == 2, f"only ingress replica(s) {pids} answered in 60 s"
            ingress_pid = pids.pop()
            started = asyncio.Event()

            async def stream() -> list:
                events: list = []
                async with session.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                    if response.status_code != 200:  # killed before its first token: the headers were not sent
                        await response.aread()
                        return [response]
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            payload = line[len("data: ") :]
                            events.append(payload if payload == "[DONE]" else json.loads(payload))
                            started.set()
                return events

            streams = [asyncio.create_task(stream()) for _ in range(6)]
            collected = asyncio.create_task(session.post("/v1/completions", json=long))
            await asyncio.wait_for(started.wait(), 30)
            os.kill(ingress_pid, signal.SIGKILL)
            # Nothing hangs: every stream ends, well inside the client's timeout.
            return await asyncio.wait_for(asyncio.gather(*streams), 60), await collected

    cut, in_flight = asyncio.run(cut())
    completed = 0
    for events in cut:
        if isinstance(events[0], httpx.Response):
            assert_replica_failed(events[0])
            continue
        assert events[-1] == "[DONE]", events[-3:]
        if "error" in events[-2]:  # its ingress was the one killed
            assert events[-2]["error"]["type"] == "server_error" and events[-2]["error"]["code"] == "replica_failed"
        else:
            completed += 1
    # The proxy spreads six streams over both ingress replicas: the other one's streams run to the end.
    assert completed >= 1, "no stream survived on the ingress replica that was not killed"
    # The request that had not answered yet: Serve may run it again on another replica (200), or else
    # it gets JSON 503 that says when to retry, never a bare 500.
    if in_flight.status_code != 200:
        assert_replica_failed(in_flight)

    def served_again() -> bool:
        response = httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=HEADERS, timeout=60
        )
        assert response.headers["content-type"] == "application/json", response.text
        return response.status_code == 200

    assert wait_until(served_again, timeout_s=120, interval_s=0.25)


def test_serve_deploy_of_a_config_whose_key_is_unset_keeps_the_running_app(head, url, model_dir, tmp_path):
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    serve_deploy(head, _config(port, model_dir, "GPT2_PROXY_TEST_UNSET_KEY"), tmp_path)
    status = wait_until(lambda: (s := app_status(head)).get("status") == "DEPLOY_FAILED" and s, 90, interval_s=0.25)
    # Refused by the app builder (its words), before Serve touched the running replica.
    assert status and "GPT2_PROXY_TEST_UNSET_KEY" in status["message"], app_status(head)
    assert "where the app is built" in status["message"], status["message"]
    # Still served by the replica that was running: Serve reports DEPLOY_FAILED once it has dropped the new
    # config and kept the running app's targets, so a few requests over two seconds show it.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        response = httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=HEADERS, timeout=30
        )
        assert response.status_code == 200, response.text
        time.sleep(0.5)
