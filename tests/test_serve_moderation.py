"""Moderation in the Serve app, end to end over HTTP: blocked prompts get a 400, blocked completions are
withheld with finish_reason content_filter (streamed or not), the replica keeps serving, the metric counts.

One app for the module, checking prompts and completions with a blocklist and the test policy
(helpers_moderation: completions over 8 characters are blocked, the word 'explode' makes it raise).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray.cloudpickle

import helpers_moderation
import test_serve
from conftest import prometheus_lines
from test_serve import FAST_DRAIN, assert_openai_error, engine_stats, sse_events, wait_until

model_dir = test_serve.model_dir  # the fixture: a tiny model trained to write ASCII, with the byte tokenizer

APP = "gpt2-moderation-test"
MODEL_NAME = "tiny-moderated"
SHORT = helpers_moderation.MAX_COMPLETION_CHARS - 2  # max_tokens the policy lets through (one byte per token)
MODERATION = {
    "enabled": True,
    "check": "both",
    "blocklist": ["forbidden phrase", "zap"],
    "callable": "helpers_moderation:policy",
}


@pytest.fixture(scope="module")
def base_url(serve_port: int, model_dir: Path) -> Iterator[str]:
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    # The replica gets the policy by value: it cannot import the tests folder (a real deployment ships
    # its moderation module with the job's working_dir or an installed package).
    ray.cloudpickle.register_pickle_by_value(helpers_moderation)
    args = {
        "model": str(model_dir),
        "served_model_name": MODEL_NAME,
        "engine": {"dtype": "fp32", "max_batch_size": 4},
        "moderation": MODERATION,
    }
    app = gpt2_deployment(args, engine_options=FAST_DRAIN, ray_actor_options={"num_cpus": 1}, **FAST_DRAIN)
    serve.run(app, name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{serve_port}"
    finally:
        serve.delete(APP)


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def assert_content_policy_400(response: httpx.Response, reason: str) -> None:
    error = assert_openai_error(response, 400, "prompt")
    assert error["type"] == "invalid_request_error" and error["code"] == "content_policy_violation"
    assert reason in error["message"], error


def test_a_blocked_prompt_gets_a_400_before_generation_and_the_replica_keeps_serving(client):
    before = engine_stats(client)["generated_tokens"]
    for prompt in ("say the Forbidden   Phrase now", ["fine", "zap it"], list(b"zap it")):  # ids spell the text
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": SHORT})
        assert_content_policy_400(response, "blocklist term")
    assert "prompt 1 was refused" in client.post("/v1/completions", json={"prompt": ["fine", "zap"]}).text
    # The policy raises on this word: the prompt is blocked (fail closed), the replica is unharmed.
    response = client.post("/v1/completions", json={"prompt": "please explode", "max_tokens": SHORT})
    assert_content_policy_400(response, "moderation error")
    assert_content_policy_400(client.post("/generate", json={"prompt": "zap", "max_length": 5}), "blocklist term")
    assert engine_stats(client)["generated_tokens"] == before, "a blocked prompt reached the engine"
    assert client.get("/health").json()["status"] == "ok"


def test_an_allowed_prompt_passes(client):
    body = client.post("/v1/completions", json={"prompt": "zapping is fine", "max_tokens": SHORT, "ignore_eos": True})
    assert body.status_code == 200, body.text
    (choice,) = body.json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"]) == SHORT


def test_a_blocked_completion_is_withheld_with_finish_reason_content_filter(client):
    request = {"prompt": ["alice has", "bob has"], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("", "content_filter")] * 2
    assert body["usage"]["completion_tokens"] == 40  # generated, then withheld
    short = client.post("/v1/completions", json={**request, "max_tokens": SHORT}).json()
    assert all(c["finish_reason"] == "length" and c["text"] for c in short["choices"])
    generated = client.post("/generate", json={"prompt": "alice has", "max_length": 40, "temperature": 0}).json()
    assert generated["generated_text"] == "alice has" and generated["finish_reason"] == "content_filter"


def test_a_blocked_stream_stops_with_content_filter_and_frees_its_slot(client):
    idle = wait_until(lambda: (s := engine_stats(client))["running"] == 0 and s, timeout_s=10)
    request = {"prompt": "a long story", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "content_filter" and chunks[-1]["text"] == ""
    assert len("".join(c["text"] for c in chunks)) <= helpers_moderation.MAX_COMPLETION_CHARS
    after = wait_until(lambda: (s := engine_stats(client))["running"] == 0 and s, timeout_s=10)
    assert after, "the stopped stream still holds its slot"
    assert after["generated_tokens"] - idle["generated_tokens"] < 240, "the sequence ran on after it was blocked"


def test_the_metric_counts_blocked_prompts_and_completions_by_kind(client):
    for _ in range(2):
        assert client.post("/v1/completions", json={"prompt": "zap"}).status_code == 400
        blocked = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "ignore_eos": True})
        assert blocked.json()["choices"][0]["finish_reason"] == "content_filter"

    def count(kind: str) -> float:
        lines = prometheus_lines("ray_gpt2_serve_moderation_blocked_total", tag=f'model="{MODEL_NAME}"', timeout_s=2)
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'kind="{kind}"' in line)

    # Export is periodic: wait until this app's counts include the ones just made (earlier tests add more).
    assert wait_until(lambda: count("prompt") >= 2 and count("completion") >= 2, timeout_s=40, interval_s=0.25)
