"""`jobs/bench_serve.py --config`: the benchmark deploys a shipped Serve config as it is, through Serve's
own config path and behind HAProxy (the cluster's ingress), with only the model swapped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bench_serve_deploys_the_shipped_config_behind_haproxy(tmp_path):
    report_path = tmp_path / "serve.json"
    command = [
        sys.executable,
        str(REPO / "jobs" / "bench_serve.py"),
        "--config",
        str(REPO / "deployments" / "gpt2.yaml"),
    ]
    command += ["--start-preset", "tiny", "--no-engine-baseline", "--url", f"http://127.0.0.1:{_free_port()}"]
    command += ["--concurrency", "3", "--requests", "6", "--prompt-tokens", "8", "--max-tokens", "4"]
    command += ["--json-out", str(report_path)]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    shipped = yaml.safe_load((REPO / "deployments" / "gpt2.yaml").read_text())["applications"][0]
    app = report["app"]
    assert app["ingress"] == "haproxy"
    # What ran is the file's own settings: the engine and limits as shipped, the model swapped.
    assert app["args"]["engine"] == shipped["args"]["engine"]
    assert app["args"]["limits"] == shipped["args"]["limits"]
    assert app["args"]["model"] != shipped["args"]["model"]
    assert app["deployments"] == shipped["deployments"]
    [level] = report["levels"]
    assert (level["requests"], level["failed"]) == (6, 0)
    assert level["generated_tokens_per_s"] > 0


def test_bench_serve_refuses_a_config_without_a_model():
    command = [sys.executable, str(REPO / "jobs" / "bench_serve.py"), "--config", "deployments/gpt2.yaml"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert "--config needs the model to serve" in done.stderr
