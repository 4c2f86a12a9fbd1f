"""The HAProxy ingress the cluster configs turn on: the shipped local config deployed behind real HAProxy,
through serve/haproxy.py's launcher, keeps the API key and the app's JSON errors, and HAProxy's own
503 (no ingress replica up) reaches clients as OpenAI JSON with Retry-After."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gpt2_platform.serve import haproxy

REPO = Path(__file__).resolve().parents[1]

# Deploys deployments/gpt2.yaml as it ships (a tiny model swapped in, an API key required) on a Ray of its own behind HAProxy,
# prints where, and serves until its stdin closes.
DEPLOY = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import ray, yaml
    from gpt2_platform.bench import serve_app
    from gpt2_platform.bench.models import write_model

    model_dir, port, config = Path(sys.argv[1]), int(sys.argv[2]), yaml.safe_load(Path(sys.argv[3]).read_text())
    write_model(model_dir, "tiny")
    config["applications"][0]["args"]["api_key_env"] = "GPT2_API_KEY"  # as gpt2-cluster.yaml has it
    Path("config.yaml").write_text(yaml.safe_dump(config))
    app = serve_app.deploy_config(Path("config.yaml"), model_dir, port, "haproxy")
    print(json.dumps({"url": app["url"], "api_key": app["api_key"]}), flush=True)
    sys.stdin.read()
    ray.shutdown()  # the Ray this process started, HAProxy included
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("haproxy")
    # HAProxy's config (and the launcher's error pages) where this test finds them, not in /tmp/haproxy-serve.
    config_dir = Path(tempfile.mkdtemp(prefix="gpt2-hx-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] = str(config_dir / "haproxy.cfg")
    env["PYTHONPATH"] = str(REPO / "platform")
    command = [
        sys.executable,
        "-c",
        DEPLOY,
        str(root / "model"),
        str(_free_port()),
        str(REPO / "deployments/gpt2.yaml"),
    ]
    process = subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(root / "log", "w"),
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line, f"the deploy exited with {process.wait()}: {(root / 'log').read_text()[-3000:]}"
        started = json.loads(line)
        headers = {"Authorization": f"Bearer {started['api_key']}"}
        model = httpx.get(f"{started['url']}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        yield {**started, "headers": headers, "model": model, "config_dir": config_dir}
    finally:
        process.stdin.close()
        process.wait(timeout=120)
        left = subprocess.run(["pgrep", "-f", str(config_dir)], capture_output=True, text=True).stdout.split()
        shutil.rmtree(config_dir, ignore_errors=True)
        assert not left, f"HAProxy processes outlived their Ray: {left}"


def _haproxy_command(app: dict, command: str) -> str:
    """A command on HAProxy's admin socket (the `stats socket` of the config it runs)."""
    [config] = app["config_dir"].glob("*/haproxy.openai.cfg")
    path = next(line.split()[2] for line in config.read_text().splitlines() if line.strip().startswith("stats socket"))
    with socket.socket(socket.AF_UNIX) as admin:
        admin.connect(path)
        admin.sendall(command.encode() + b"\n")
        return b"".join(iter(lambda: admin.recv(65536), b"")).decode()


def _ingress_servers(app: dict) -> list[str]:
    """backend/server of every ingress replica HAProxy balances."""
    state = _haproxy_command(app, "show servers state")
    rows = [row for row in (line.split() for line in state.splitlines()) if len(row) > 3 and row[0].isdigit()]
    return [f"{row[1]}/{row[3]}" for row in rows if row[1].startswith("http-")]


def test_haproxy_runs_the_launchers_config_and_keeps_the_api_key_and_the_apps_errors(app):
    [config] = app["config_dir"].glob("*/haproxy.openai.cfg")
    assert "openai-503.http" in config.read_text() and "500.http" not in config.read_text()
    body = {"model": app["model"], "prompt": "hello", "max_tokens": 3}
    assert httpx.post(f"{app['url']}/v1/completions", json=body, timeout=30).status_code == 401
    ok = httpx.post(f"{app['url']}/v1/completions", json=body, headers=app["headers"], timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    bad = httpx.post(f"{app['url']}/v1/completions", json={**body, "max_tokens": -1}, headers=app["headers"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{app['url']}/v1/nope", headers=app["headers"]).json()["error"]["type"] == "invalid_request_error"


def test_no_ingress_replica_up_is_a_json_503_with_retry_after(app):
    client = openai.OpenAI(base_url=f"{app['url']}/v1", api_key=app["headers"]["Authorization"][7:], max_retries=0)
    body = {"model": app["model"], "prompt": "hello", "max_tokens": 3}
    servers: list[str] = []
    try:
        # As when every ingress replica is down, HAProxy answers itself. Serve reloads HAProxy as replicas
        # change (a new process, with the servers' states from its config): try again if a reload came
        # between the command and the request.
        deadline = time.monotonic() + 60
        while True:
            servers = _ingress_servers(app)
            assert servers, "HAProxy balances no ingress replica"
            for server in servers:
                _haproxy_command(app, f"set server {server} state maint")
            response = httpx.post(f"{app['url']}/v1/completions", json=body, headers=app["headers"], timeout=30)
            if response.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == "application/json"
        assert 1 <= int(response.headers["retry-after"]) <= 60
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "no_replica_available"
        assert "retry the request" in error["message"]
        # The official client reads it as the API's own error.
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(**body)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "no_replica_available"
    finally:
        for server in servers:
            _haproxy_command(app, f"set server {server} state ready")
    assert client.completions.create(**body).usage.completion_tokens == 3


def test_error_pages_are_whole_http_responses_in_openais_shape():
    for status in (502, 503, 504):
        head, body = haproxy.error_page(status).split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        assert lines[0].startswith(f"HTTP/1.1 {status} ")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        assert int(headers["Content-Length"]) == len(body)
        assert headers["Content-Type"] == "application/json" and int(headers["Retry-After"]) > 0
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_rewrite_points_every_errorfile_at_its_page_and_adds_them_where_serve_wrote_none(tmp_path):
    pages = haproxy.write_error_pages(tmp_path)
    served = "defaults\n    mode http\n    errorfile 502 /x/500.http\n    errorfile 503 /x/500.http\n    errorfile 504 /x/500.http\n"
    rewritten = haproxy.rewrite_config(served, pages)
    assert "/x/500.http" not in rewritten
    assert [line.split()[-1] for line in rewritten.splitlines() if "errorfile" in line] == [
        str(pages[502]),
        str(pages[503]),
        str(pages[504]),
    ]
    bare = haproxy.rewrite_config("global\n    maxconn 10\ndefaults\n    mode http\nfrontend f\n", pages)
    assert bare.index("errorfile 503") > bare.index("defaults") and bare.index("errorfile 503") < bare.index("frontend")
