"""The serving benchmark's load generator against a real local HTTP server in OpenAI's shape (no Ray)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gpt2_platform.bench import load, load_report, processes

MAX_TOKENS = 6
# Requests whose prompt_ids index is one of these fail, whatever process or order they run in.
INDEX_429, INDEX_500, INDEX_BROKEN_STREAM = 1, 2, 3
# Refused once with a Retry-After, then served; refused with a Retry-After of an hour, always.
INDEX_429_ONCE, INDEX_429_HOUR = 20, 21  # past the other tests' requests


def _request_index(prompt: list[int]) -> int:
    # prompt_ids(length, index)[0] = 32 + 7 * index mod 95, and 68 = 7^-1 mod 95.
    return ((prompt[0] - 32) * 68) % 95


def fake_completions_app() -> FastAPI:
    app = FastAPI()
    refused_once: set[tuple] = set()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-gpt2", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        index, num_tokens = _request_index(body["prompt"]), body["max_tokens"]
        if index == INDEX_429:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit"}}, status_code=429)
        if index == INDEX_429_ONCE and (key := (index, body.get("stream"))) not in refused_once:
            refused_once.add(key)
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "0.05"})
        if index == INDEX_429_HOUR:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "3600"})
        if index == INDEX_500:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": num_tokens}
        if not body.get("stream"):
            await asyncio.sleep(0.002 * num_tokens)
            choice = {"index": 0, "text": "a" * num_tokens, "finish_reason": "length"}
            return {"object": "text_completion", "choices": [choice], "usage": usage}

        async def events():
            for position in range(num_tokens):
                await asyncio.sleep(0.002)
                if index == INDEX_BROKEN_STREAM and position == 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                    return
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # an ephemeral port, held until uvicorn takes the socket
    server = uvicorn.Server(uvicorn.Config(fake_completions_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def settings_for(url: str, num_requests: int = 12) -> load.LoadSettings:
    return load.LoadSettings(url=url, prompt_tokens=8, max_tokens=MAX_TOKENS, num_requests=num_requests)


def test_streaming_level_counts_tokens_and_failures(server_url):
    settings = settings_for(server_url)
    model = load.discover_model(settings)
    assert model == "fake-gpt2"
    level = load.run_level(None, settings, load.request_body(settings, model, "stream"), concurrency=4)
    assert (level.mode, level.requests, level.failed) == ("stream", 12, 3)
    assert level.failed_by_status == {"200": 1, "429": 1, "500": 1}  # the 200 broke with an error chunk
    assert level.generated_tokens_per_s * level.seconds == pytest.approx(9 * MAX_TOKENS)
    assert level.requests_per_s * level.seconds == pytest.approx(9)
    # Six chunks 2 ms apart: the first arrives well before the last.
    assert 0 < level.ttft_p50_ms < level.latency_p50_ms and level.per_token_p50_ms > 1
    assert 0 < level.client_cpu_pct <= 100


def test_nonstreaming_level_reports_latency_as_ttft(server_url):
    settings = settings_for(server_url)
    body = load.request_body(settings, "fake-gpt2", "nonstream")
    assert body["stream"] is False and "stream_options" not in body
    level = load.run_level(None, settings, body, concurrency=3)
    assert (level.mode, level.requests, level.failed) == ("nonstream", 12, 2)
    assert level.failed_by_status == {"429": 1, "500": 1}
    assert level.generated_tokens_per_s * level.seconds == pytest.approx(10 * MAX_TOKENS)
    assert level.ttft_p50_ms == level.latency_p50_ms > 0 and level.ttft_p99_ms == level.latency_p99_ms
    assert math.isnan(level.per_token_p50_ms)
    assert "= latency" in load_report.markdown_row(level, with_engine=False)
    assert "TTFT is the whole request's latency" in load_report.as_markdown([level])


def test_a_429_is_retried_after_its_retry_after_within_the_budget(server_url):
    settings = load.LoadSettings(url=server_url, prompt_tokens=8, max_tokens=MAX_TOKENS, num_requests=22)
    level = load.run_level(None, settings, load.request_body(settings, "fake-gpt2", "stream"), concurrency=22)
    # 20 waited its 0.05 s and was served; 21's hour is past the budget; 1's 429 gave no Retry-After.
    assert level.retried_429 == 1
    assert level.failed_by_status == {"200": 1, "429": 2, "500": 1}
    assert "1 429s retried" in load_report.markdown_row(level, with_engine=False)
    no_retry = load.LoadSettings(**{**settings.__dict__, "retry_429_within_s": 0.0})
    level = load.run_level(None, no_retry, load.request_body(settings, "fake-gpt2", "nonstream"), concurrency=22)
    assert level.retried_429 == 0 and level.failed_by_status["429"] == 3


def test_level_reports_the_processes_that_used_the_cpu(server_url):
    if processes.psutil is None:
        pytest.skip("psutil is not importable (neither installed nor vendored by Ray)")
    settings = settings_for(server_url, num_requests=8)
    level = load.run_level(None, settings, load.request_body(settings, "fake-gpt2", "stream"), concurrency=2)
    shares = level.process_cpu
    assert shares["available"] and shares["wall_s"] > 0
    # This process is both the load generator and (in a thread) the server.
    names = {row["role"]: row for row in shares["top"]}
    assert names["load generator"]["cpu_pct"] > 0
    assert "load generator" in processes.as_line(shares)


def test_sampler_counts_busy_work_and_survives_processes_that_end():
    if processes.psutil is None:
        pytest.skip("psutil is not importable (neither installed nor vendored by Ray)")
    short_lived = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    before = processes.snapshot()
    short_lived.kill()
    short_lived.wait()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = processes.snapshot()
    assert any(pid == short_lived.pid for pid, _ in before.cpu_s)
    assert not any(pid == short_lived.pid for pid, _ in after.cpu_s)
    shares = processes.cpu_shares(before, after)
    own = next(row for row in shares["top"] if row["role"] == "load generator")
    assert own["cpu_s"] >= 0.25 and own["cpu_pct"] > 0
    assert shares["total_cpu_pct"] >= own["cpu_pct"]


def test_sampler_without_psutil_reports_no_data():
    empty = processes.Snapshot(taken_at=0.0, available=False)
    shares = processes.cpu_shares(empty, processes.Snapshot(taken_at=1.0, available=False))
    assert shares == {"available": False, "wall_s": 1.0, "top": []}
    assert "no data" in processes.as_line(shares)


@pytest.mark.parametrize(
    "name, cmdline, parent, role",
    [
        ("ray::ServeRepli", ["ray::ServeReplica:gpt2:GPT2Ingress"], None, "GPT2Ingress"),
        ("ray::ServeRepli", ["ray::ServeReplica:gpt2:GPT2Ingress.handle_request_streaming"], None, "GPT2Ingress"),
        ("ray::ProxyActor", ["ray::ProxyActor", ""], None, "ProxyActor"),
        (
            "python",
            ["/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"],
            "ray:GPT2Engine",
            "gpt2-engine",
        ),
        ("python", ["/venv/bin/python", "-c", "import sys\n...", "5", "gpt2-engine"], "ray:GPT2Engine", "gpt2-engine"),
        ("python", ["python", "-c", "from multiprocessing.resource_tracker import main;main(9)"], None, None),
        ("haproxy", ["/usr/sbin/haproxy", "-f", "/tmp/x.cfg"], None, "haproxy"),
        ("raylet", ["/venv/lib/ray/core/src/ray/raylet/raylet", "--node_id=1"], None, "raylet"),
        ("gcs_server", ["/venv/lib/ray/core/src/ray/gcs/gcs_server", "--port=1"], None, "gcs_server"),
        ("python", ["/venv/bin/python", "/venv/lib/site-packages/ray/dashboard/agent.py"], None, "ray dashboard/agent"),
        ("python3", ["python3", "-m", "pytest", "-q"], None, "pytest"),
    ],
)
def test_process_roles(name, cmdline, parent, role):
    assert processes.role_of(name, cmdline, parent) == (role or "resource_tracker")


def test_percentile():
    values = [float(v) for v in range(1, 101)]
    assert load.percentile(values, 50) == pytest.approx(50.5)
    assert load.percentile(values, 99) == pytest.approx(99.01)
    assert load.percentile([7.0], 99) == 7.0 and math.isnan(load.percentile([], 50))


def test_prompts_have_the_exact_length_and_differ():
    assert len(load.prompt_ids(128, 0)) == 128
    assert load.prompt_ids(16, 1) != load.prompt_ids(16, 2)
    assert [_request_index(load.prompt_ids(4, i)) for i in range(95)] == list(range(95))


def test_engine_baseline_sets_the_ratio():
    levels = [_level("stream", 4, 800.0), _level("nonstream", 4, 900.0), _level("stream", 8, 1000.0)]
    load.attach_engine_baseline(levels, {4: 1000.0})
    assert [lv.http_to_engine_ratio for lv in levels] == [pytest.approx(0.8), pytest.approx(0.9), None]
    assert "1000 (0.80)" in load_report.as_markdown(levels)


def test_cli_sweeps_both_modes_and_writes_json_and_plot(server_url, tmp_path):
    report_path, plot_path = tmp_path / "serve.json", tmp_path / "serve.png"
    script = Path(__file__).resolve().parents[1] / "jobs" / "bench_serve.py"
    command = [sys.executable, str(script), "--url", server_url, "--json-out", str(report_path), "--mode", "both"]
    command += ["--concurrency", "1", "2", "--requests", "5", "--prompt-tokens", "8", "--max-tokens", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert [(lv["mode"], lv["concurrency"], lv["requests"], lv["failed"]) for lv in report["levels"]] == [
        ("stream", 1, 5, 3),
        ("nonstream", 1, 5, 2),
        ("stream", 2, 5, 3),
        ("nonstream", 2, 5, 2),
    ]
    assert report["engine_baseline"] is None and report["config"]["mode"] == "both"
    assert all("top" in lv["process_cpu"] for lv in report["levels"])
    if _has_matplotlib():
        assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not plot_path.exists() and "--plot-from" in done.stdout
    # The chart again, later, from the JSON alone.
    redraw = tmp_path / "again.png"
    command = [sys.executable, str(script), "--plot-from", str(report_path), "--plot-out", str(redraw)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert redraw.exists() == _has_matplotlib()


def test_plot_from_a_report(tmp_path):
    report = {
        "model": "gpt2",
        "config": {"prompt_tokens": 128, "max_tokens": 128},
        "engine_baseline": {
            "rows": [{"batch_size": 1, "tokens_per_s": 300.0}, {"batch_size": 4, "tokens_per_s": 1100.0}]
        },
        "levels": [vars(_level(mode, c, 100.0 * c)) for mode in load.MODES for c in (1, 4)],
    }
    written = load_report.plot(report, tmp_path / "chart.png")
    if not _has_matplotlib():
        assert written is None
        pytest.skip("matplotlib is not installed: only the skip path ran")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _level(mode: str, concurrency: int, tokens_per_s: float) -> load.LevelResult:
    return load.LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=8,
        failed=0,
        seconds=1.0,
        requests_per_s=8.0,
        generated_tokens_per_s=tokens_per_s,
        ttft_p50_ms=10.0,
        ttft_p99_ms=20.0,
        latency_p50_ms=50.0,
        latency_p99_ms=60.0,
        per_token_p50_ms=1.0,
        per_token_p99_ms=2.0,
        client_cpu_pct=10.0,
    )


def test_engine_split_gives_per_level_means_from_the_engines_counters():
    before = {"steps": 10, "generated_tokens": 100, "first_tokens": 4, "queue_s": 0.5, "first_token_s": 0.2}
    after = {"steps": 30, "generated_tokens": 2100, "first_tokens": 14, "queue_s": 0.6, "first_token_s": 0.3}
    before["gc_count"], before["gc_s"] = [5, 2, 1], [0.0, 0.0, 0.1]
    after["gc_count"], after["gc_s"] = [9, 3, 3], [0.0, 0.0, 0.25]
    after["ingress"] = {"gc_count": [1, 1, 7], "gc_longest_s": [0.0, 0.0, 0.002]}
    split = load.engine_split(before, after)
    assert split["steps"] == 20 and split["tokens_per_step"] == 100
    assert round(split["queue_ms"], 6) == 10 and round(split["admission_to_first_token_ms"], 6) == 10
    assert split["engine_full_gcs"] == 2 and round(split["engine_full_gc_ms"], 6) == 150
    assert split["ingress_full_gcs_since_start"] == 7 and round(split["ingress_longest_full_gc_ms"], 6) == 2
    assert load.engine_split(None, after) is None
    assert load.engine_split({"steps": 1}, after) is None  # another server's stats


def test_level_lines_and_engine_comparison():
    level = _level("stream", 4, 800.0)
    level.engine_split = {"steps": 10, "tokens_per_step": 3.2, "queue_ms": 1.5, "admission_to_first_token_ms": 2.25}
    level.engine_split["engine_full_gcs"] = 1
    lines = load_report.level_lines(level)
    assert lines[0] == load_report.markdown_row(level, with_engine=False)
    assert "10 steps, 3.2 tokens a step" in lines[1] and "1.50 ms for a slot" in lines[1]
    assert lines[2] == "  full garbage collections: {'engine_full_gcs': 1}"
    assert load_report.engine_comparison_lines([level]) == []  # no baseline, no comparison
    load.attach_engine_baseline([level], {4: 1000.0})
    assert load_report.engine_comparison_lines([level])[-1].endswith("engine 1,000 tokens/s, HTTP / engine 0.80")
