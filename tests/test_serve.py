"""Serving end to end on CPU: a tiny model behind real Ray Serve, over real HTTP.

One app serves most tests (replica start costs seconds); the overload test
changes its limits live through `user_config`, the kill test replaces its
replica, and the autoscaling test deploys a second app of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from gpt2_platform import demo_data
from gpt2_platform.monitoring import exporter
from gpt2_platform.tokenizer import byte_tokenizer

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key-7a1c"
API_KEY_ENV = "GPT2_SERVE_TEST_API_KEY"
APP = "gpt2-test"
MODEL_NAME = "tiny-test"
LIMITS = {
    "max_body_bytes": 20_000,
    "max_prompts": 4,
    "max_n": 4,
    "max_stop": 2,
    "max_tokens_cap": 250,
    "default_max_tokens": 16,
    "max_waiting": 8,
    "max_queue_wait_s": 30,  # a loaded CPU's queue of long sequences still joins (the queue tests below)
    "body_timeout_s": 2.0,  # short, so the slow-client test waits seconds
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(ascii_model_dir: Path) -> Path:
    """A tiny GPT-2 trained for a few seconds on the demo stories (so it writes ASCII), with its tokenizer
    (conftest.py: one for the session's Serve and engine-process tests)."""
    return ascii_model_dir


# Serve drains a stopping replica in loops of 2 s by default, at least one even when nothing is in flight:
# every app deleted or redeployed, and every replica scaled down, waited that long. No test checks draining.
FAST_DRAIN = {"graceful_shutdown_wait_loop_s": 0.1}
# Half a CPU each: the module's app and the autoscaling test's, with its second ingress replica, fit the
# test cluster's 4 CPUs.
ENGINE_OPTIONS = {"ray_actor_options": {"num_cpus": 0.5}, **FAST_DRAIN}


def _main_args(model_dir: Path) -> dict:
    return {
        "model": str(model_dir),
        "served_model_name": MODEL_NAME,
        "engine": {"dtype": "fp32", "max_batch_size": 4},
        "api_key_env": API_KEY_ENV,
        "limits": LIMITS,
    }


def _deploy_main(model_dir: Path, **options) -> None:
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    # The key reaches the replica through its environment, as a deployment's runtime_env would set it.
    options.setdefault("ray_actor_options", {"num_cpus": 0.5, "runtime_env": {"env_vars": {API_KEY_ENV: API_KEY}}})
    # Serve checks a replica's health every 10 s by default: the kill test's replica was replaced only after
    # the next check found it gone.
    options.setdefault("health_check_period_s", 1)
    app = gpt2_deployment(_main_args(model_dir), engine_options=ENGINE_OPTIONS, **FAST_DRAIN, **options)
    serve.run(app, name=APP, route_prefix="/")


@pytest.fixture(scope="module")
def base_url(serve_port: int, model_dir: Path) -> Iterator[str]:
    from ray import serve

    _deploy_main(model_dir)
    try:
        yield f"http://127.0.0.1:{serve_port}"
    finally:
        serve.delete(APP)


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as client:
        yield client


def complete(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response: dicts, and the final '[DONE]'."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def engine_stats(client: httpx.Client) -> dict:
    response = client.get("/v1/engine/stats")
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


# ---- the config file ------------------------------------------------------------------------------
def test_the_yaml_is_a_valid_serve_config_whose_args_validate():
    from ray.serve.schema import ServeDeploySchema

    from gpt2_platform.serve import app as app_module
    from gpt2_platform.serve.schemas import AppArgs

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "deployments" / "gpt2.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"
    (application,) = config.applications
    module, _, attribute = application.import_path.partition(":")
    assert getattr(importlib.import_module(module), attribute) is app_module.build_app
    args = AppArgs.model_validate(application.args)
    deployments = {deployment.name: deployment for deployment in application.deployments}
    assert set(deployments) == {app_module.GPT2Server.name, app_module.GPT2Engine.name}
    server, engine = deployments[app_module.GPT2Server.name], deployments[app_module.GPT2Engine.name]
    assert server.max_ongoing_requests >= 2 * server.autoscaling_config["target_ongoing_requests"]
    assert server.autoscaling_config["min_replicas"] >= 1
    assert server.ray_actor_options.num_gpus == 0  # the ingress never holds a model
    # Left to the builder, which leaves room for every sequence an engine may hold.
    assert "max_ongoing_requests" not in engine.model_fields_set
    assert app_module.default_max_ongoing_requests(args) > args.engine.max_batch_size + args.limits.max_waiting
    assert engine.autoscaling_config["policy"]["policy_function"] == "gpt2_platform.serve.autoscaling:sequences_policy"
    assert engine.autoscaling_config["target_ongoing_requests"] <= args.engine.max_batch_size
    assert engine.ray_actor_options.num_gpus == 0  # the local config runs on CPU


def test_the_builder_refuses_a_missing_model_directory_and_typos_in_args(tmp_path):
    from pydantic import ValidationError

    from gpt2_platform.serve.app import build_app
    from gpt2_platform.serve.schemas import AppArgs

    with pytest.raises(ValueError, match="make demo"):
        build_app(AppArgs(model=str(tmp_path / "missing" / "model")))
    with pytest.raises(ValidationError, match="max_batch_sise"):
        AppArgs.model_validate({"model": "x", "max_batch_sise": 4})


def test_on_the_cluster_the_builder_refuses_an_unset_api_key_and_says_where_a_relative_path_resolves(
    ray_cluster, model_dir, caplog
):
    import ray

    from gpt2_platform.serve.app import build_app
    from gpt2_platform.serve.schemas import AppArgs

    @ray.remote(num_cpus=0)
    def build(args: dict) -> str:  # where `serve deploy` runs the builder: a task on the cluster
        try:
            build_app(AppArgs.model_validate(args))
        except ValueError as error:
            return str(error)
        return "built"

    unset = {"model": str(model_dir), "api_key_env": "GPT2_TEST_UNSET_KEY"}
    assert "GPT2_TEST_UNSET_KEY" in ray.get(build.remote(unset))
    message = ray.get(build.remote({"model": "runs/nowhere/model"}))
    assert "resolved where the app is built" in message and "absolute path" in message, message
    # In a driver (`serve run module:app`, Python) the builder's environment need not be the
    # replicas', so an unset key there is only a warning.
    build_app(AppArgs.model_validate(unset))
    assert "GPT2_TEST_UNSET_KEY" in caplog.text


def test_metric_names_are_ones_prometheus_keeps(ray_cluster):
    from gpt2_platform.serve.metrics import ServeMetrics

    metrics = ServeMetrics("m")
    names = [value._name for value in vars(metrics).values() if hasattr(value, "_name")]
    assert "gpt2_serve_time_to_first_token_s" in names and len(names) >= 8
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name) for name in names), names


# ---- what clients get -----------------------------------------------------------------------------
def test_health_and_models(client, base_url):
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"  # no key needed
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == 256


def test_a_completion_has_openai_fields_and_usage(client):
    prompt = "alice has 3 apples."
    body = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert abs(body["created"] - time.time()) < 60
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"].isascii() and len(choice["text"]) == 10  # one byte per token
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 10, "total_tokens": len(prompt) + 10}


def test_list_prompts_token_prompts_and_n_choices_with_derived_seeds(client):
    prompts = ["alice has", "bob gives carol"]
    body = complete(client, prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] != choices[1]["text"], "choices of one prompt use seeds 5 and 6"
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 48
    again = complete(client, prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices], "a seeded request reproduces"
    # The same prompt as token ids (the byte tokenizer: one id per byte) gives the same text.
    by_ids = complete(client, prompt=list(b"alice has"), max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert by_ids["choices"][0]["text"] == choices[0]["text"]


def test_streaming_sends_chunks_then_done_and_the_same_text_as_without(client):
    request = {"prompt": "carol has 4 pens.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = complete(client, **request)["choices"][0]["text"]
    stream_options = {"include_usage": True}
    with client.stream(
        "POST", "/v1/completions", json={**request, "stream": True, "stream_options": stream_options}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) > 1 and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 24


def test_generate_returns_the_prompt_and_its_continuation(client):
    response = client.post("/generate", json={"prompt": "alice has", "max_length": 20, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["generated_text"].startswith("alice has") and len(body["generated_text"].encode()) <= 20
    assert 0 < body["inference_time"] < 30


def test_concurrent_requests_are_decoded_in_shared_batches(client, base_url):
    before = engine_stats(client)["batch_sizes"]

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as session:
            requests = [
                session.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 40, "ignore_eos": True})
                for i in range(8)
            ]
            return await asyncio.gather(*requests)

    responses = asyncio.run(fire())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    stats = engine_stats(client)
    assert stats["max_batch_size_seen"] > 1
    shared = {size: count - before.get(size, 0) for size, count in stats["batch_sizes"].items() if int(size) > 1}
    assert sum(shared.values()) > 0, f"no decode step ran more than one sequence: {stats['batch_sizes']}"


def test_the_load_generator_split_over_client_processes_counts_every_request(base_url, tmp_path):
    # jobs/bench_serve.py against this app, its requests spread over two spawned client processes.
    report = tmp_path / "bench.json"
    script = Path(__file__).resolve().parents[1] / "jobs" / "bench_serve.py"
    command = [sys.executable, str(script), "--url", base_url, "--api-key", API_KEY, "--json-out", str(report)]
    command += ["--concurrency", "1", "3", "--requests", "6", "--prompt-tokens", "8", "--max-tokens", "5"]
    done = subprocess.run([*command, "--client-processes", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    levels = json.loads(report.read_text())["levels"]
    assert [(level["concurrency"], level["requests"], level["failed"]) for level in levels] == [(1, 6, 0), (3, 6, 0)]
    for level in levels:
        # Every request's 5 tokens counted once, whichever process sent it.
        assert level["generated_tokens_per_s"] == pytest.approx(6 * 5 / level["seconds"])
        assert 0 < level["client_cpu_pct"] < 100 and level["ttft_p50_ms"] > 0


# ---- bad input: OpenAI-style 4xx, never a 5xx --------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": "x" * 250, "max_tokens": 100}, 400, "max_tokens"),  # over the 256-token context
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["ok", ""]}, 400, "prompt"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -1}, 400, "top_k"),
    ({"prompt": "x", "top_k": 2**70}, 400, "top_k"),  # would overflow the engine's int64 tensors
    ({"prompt": "x", "top_k": 2**31}, 400, "top_k"),  # past the engine's MAX_TOP_K
    ({"prompt": "a\ud800b"}, 400, "prompt"),  # a lone surrogate: valid JSON, not text
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 5}, 400, "n"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 251}, 400, "max_tokens"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, 400, "stop"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs"),  # OpenAI's most is 5
    ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": 1.5}, 400, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": [65] * 258, "echo": True, "max_tokens": 0, "logprobs": 0}, 400, "prompt"),  # over context + 1
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": [1, 99999]}, 400, "prompt"),  # a token id outside the vocabulary
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "stop": "y" * 129}, 400, "stop"),  # over limits.max_stop_chars (128)
    ({"prompt": None}, 400, "prompt"),  # null means the default, and prompt has none
    # Bytes no 256-token context can hold (no token of the byte tokenizer spells more than 13 bytes):
    # refused before it is tokenized.
    ({"prompt": "x" * 19_000}, 400, "max_tokens"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests_get_openai_errors(client, body, status, param):
    # json.dumps escapes non-ASCII (httpx's json= would fail to encode a lone surrogate).
    content = json.dumps(body).encode()
    response = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, status, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "alice has", "max_length": 5}, "max_length"),  # shorter than the prompt
        ({"prompt": "x", "max_length": 400}, "max_length"),  # over the context
        ({"prompt": "x", "temperature": "warm"}, "temperature"),
        ({"max_length": 5}, "prompt"),
    ],
)
def test_bad_generate_requests_get_openai_errors(client, body, param):
    assert_openai_error(client.post("/generate", json=body), 400, param)


def test_malformed_and_oversized_bodies(client):
    headers = {"Content-Type": "application/json"}
    error = assert_openai_error(client.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400, None)
    assert error["code"] == "invalid_json"
    assert_openai_error(client.post("/v1/completions", content=b'{"prompt": NaN}', headers=headers), 400, None)
    assert_openai_error(client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400, None)
    # Declared too large: refused from Content-Length alone.
    big = json.dumps({"prompt": "x" * 30_000}).encode()
    assert_openai_error(client.post("/v1/completions", content=big, headers=headers), 413, None)

    # No Content-Length (chunked): refused while reading.
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"x" * 1000
        yield b'"}'

    assert_openai_error(client.post("/v1/completions", content=chunks(), headers=headers), 413, None)
    assert_openai_error(client.get("/v1/nowhere"), 404, None)
    assert complete(client, prompt="still serving", max_tokens=2)["choices"]


def test_the_api_key_is_required_except_for_health(base_url):
    request = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        response = httpx.post(f"{base_url}/v1/completions", json=request, headers=headers)
        error = assert_openai_error(response, 401, None)
        assert error["type"] == "authentication_error" and response.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{base_url}/v1/models").status_code == 401
    assert httpx.post(f"{base_url}/v1/completions", json=request, headers=AUTH).status_code == 200
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_an_explicit_null_is_the_default_and_an_unseeded_request_reports_its_seed(client):
    nulls = {"temperature": None, "top_p": None, "top_k": None, "max_tokens": None, "seed": None, "stop": None}
    body = complete(client, prompt="alice has", ignore_eos=True, stream=None, n=None, **nulls)
    (choice,) = body["choices"]
    assert body["usage"]["completion_tokens"] == LIMITS["default_max_tokens"]
    # Sent back, the seed it reports reproduces the text, streamed or not.
    again = complete(client, prompt="alice has", ignore_eos=True, seed=choice["seed"])
    assert again["choices"][0]["text"] == choice["text"] and again["choices"][0]["seed"] == choice["seed"]
    request = {"prompt": "alice has", "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and isinstance(last["seed"], int)
    reseeded = complete(client, prompt="alice has", ignore_eos=True, seed=last["seed"])["choices"][0]["text"]
    assert reseeded == "".join(c["choices"][0]["text"] for c in chunks)


def test_model_retrieval_and_chat_completions_answer_in_openai_json(client):
    card = client.get(f"/v1/models/{MODEL_NAME}")
    assert card.status_code == 200 and card.json()["id"] == MODEL_NAME and card.json()["object"] == "model"
    error = assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model")
    assert error["code"] == "model_not_found"
    chat = client.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    )
    error = assert_openai_error(chat, 404, None)
    assert "chat template" in error["message"] and "/v1/completions" in error["message"]


def test_the_openai_client_lists_retrieves_completes_and_streams(base_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    request = {"model": MODEL_NAME, "prompt": "bob has", "max_tokens": 8, "temperature": 0, "seed": 3}
    text = client.completions.create(**request).choices[0].text
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(**request, stream=True) if chunk.choices
    )
    assert len(text) == 8 and streamed == text
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL_NAME, prompt="x" * 19_000)
    with pytest.raises(openai.NotFoundError, match="chat template"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])


def test_echo_and_logprobs_score_a_prompt_and_a_greedy_completion_as_transformers_does(base_url, model_dir):
    # What lm-evaluation-harness's local-completions asks to score a continuation: echo, max_tokens 0,
    # logprobs; and generated tokens' logprobs, streamed and not. All against transformers' log_softmax.
    openai = pytest.importorskip("openai")
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    tokenizer = byte_tokenizer()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def expected_logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1)

    prompt = "alice has 3 apples."
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    (choice,) = scored.choices
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == prompt and logprobs.text_offset == list(range(len(prompt)))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = expected_logprobs(list(prompt.encode()))  # the byte tokenizer: a token per ASCII character
    for position, (token, logprob, top) in enumerate(
        zip(prompt.encode()[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    ):
        assert abs(logprob - expected[position, token].item()) < 1e-4
        best = torch.topk(expected[position], 3)
        # Keys are the tokens' text as the server's tokenizer decodes each alone.
        wanted = {tokenizer.decode([i]): v for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        assert top.keys() == wanted.keys() and list(top.values()) == pytest.approx(list(wanted.values()), abs=1e-4)

    request = {"model": MODEL_NAME, "prompt": "bob has", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    generated = client.completions.create(**request).choices[0]
    streamed = [c.choices[0] for c in client.completions.create(**request, stream=True) if c.choices]
    lp = generated.logprobs
    assert "".join(lp.tokens) == generated.text and len(lp.tokens) == 6
    assert lp.text_offset == [len("bob has") + i for i in range(6)]  # counted from the prompt's end
    full = list(b"bob has") + list(generated.text.encode())
    expected = expected_logprobs(full)[len("bob has") - 1 : -1]
    tokens = generated.text.encode()
    for position, (token, logprob, top) in enumerate(zip(tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert abs(logprob - expected[position, token].item()) < 1e-4
        assert next(iter(top)) == chr(token)  # greedy: the chosen token is the most likely
    chunks = [c.logprobs for c in streamed if c.logprobs is not None and c.logprobs.tokens]
    assert sum((c.tokens for c in chunks), []) == lp.tokens
    assert sum((c.token_logprobs for c in chunks), []) == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset

    # echo with generation, streamed: the prompt comes first, in the first chunk, with its logprobs.
    echoed = [c.choices[0] for c in client.completions.create(**request, echo=True, stream=True) if c.choices]
    assert echoed[0].text.startswith("bob has") and "".join(c.text for c in echoed) == "bob has" + generated.text
    assert echoed[0].logprobs.token_logprobs[0] is None and echoed[0].logprobs.tokens[:7] == list("bob has")


def _slow_client(port: int) -> socket.socket:
    """A connection that declares a 5,000-byte body and sends 10 bytes of it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 5000\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"prompt":')
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of a response on a raw socket (read until the server closes)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if b"transfer-encoding: chunked" in head.lower():  # one chunk: "<size>\r\n<json>\r\n0\r\n\r\n"
        body = body.split(b"\r\n")[1]
    return status, json.loads(body)


def test_slow_bodies_get_408_while_good_requests_and_health_answer_promptly(client, base_url):
    port = int(base_url.rsplit(":", 1)[1])
    slow = [_slow_client(port) for _ in range(48)]  # more than Serve's default of 32 ongoing requests before
    try:
        started = time.monotonic()
        assert client.get("/health", timeout=10).status_code == 200
        assert complete(client, prompt="still here", max_tokens=4)["choices"]
        assert time.monotonic() - started < 4, "a good request waited behind the slow clients"
        # What the replica tells the autoscaling policy to leave out of its load.
        from ray import serve

        stats = serve.get_app_handle(APP).record_autoscaling_stats.remote().result(timeout_s=10)
        assert stats == {"bodies_in_flight": len(slow)}, stats
        for sock in slow:
            status, body = _read_response(sock)
            assert status == 408, body
            assert body["error"]["code"] == "request_timeout" and "10 of 5000 bytes" in body["error"]["message"]
        # The body deadline is 2 s; the margin is for a loaded machine.
        assert time.monotonic() - started < 20
    finally:
        for sock in slow:
            sock.close()
    # They count as 408s, not as server errors (a timed-out body used to be recorded as a 500).
    from conftest import prometheus_lines

    lines = prometheus_lines("ray_gpt2_serve_requests_total", 'status="408"', at_least=len(slow))
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= len(slow), lines
    assert not [
        line for line in prometheus_lines("ray_gpt2_serve_requests_total", timeout_s=1) if 'status="500"' in line
    ]


# ---- overload, disconnects, failures, scaling ----------------------------------------------------------
def _wait_for_idle_engine(client: httpx.Client) -> dict:
    return wait_until(lambda: (s := engine_stats(client))["running"] == 0 and s["waiting"] == 0 and s, timeout_s=10)


def test_a_client_that_disconnects_frees_its_slot(client, base_url):
    request = {"prompt": "a long story", "max_tokens": 240, "ignore_eos": True}
    # Streaming: read one chunk, then hang up.
    before = _wait_for_idle_engine(client)
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            next(response.iter_lines())
    after = _wait_for_idle_engine(client)
    assert after, "the abandoned stream still holds its slot"
    assert after["generated_tokens"] - before["generated_tokens"] < 240, "the stream ran to the end"
    # Not streaming: the client gives up waiting on 16 sequences (4 rounds of the 4 slots).
    many = {**request, "prompt": ["one", "two", "three", "four"], "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=many, headers=AUTH, timeout=0.3)
    final = _wait_for_idle_engine(client)
    assert final, "the abandoned request still holds its slots"
    assert final["generated_tokens"] - after["generated_tokens"] < 16 * 240 / 2, "the request ran on"


def test_twice_the_slots_are_all_served_within_the_wait_budget(client, base_url):
    # 8 requests on 4 slots: the other 4 wait and start as slots free (limits.max_queue_wait_s), no 429.
    _wait_for_idle_engine(client)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as session:
            body = {"prompt": "queue", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*(session.post("/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses)


def test_a_queued_client_that_disconnects_leaves_the_queue_unserved(client, base_url):
    before = _wait_for_idle_engine(client)
    long = {"prompt": "hold", "max_tokens": 240, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as session:
            # 10 long sequences on 4 slots: 6 wait (limits.max_waiting is 8), two rounds of 240 steps.
            holders = [asyncio.create_task(session.post("/v1/completions", json=long)) for _ in range(10)]
            await _until(lambda: engine_stats(client)["waiting"] >= 4)
            queued = asyncio.create_task(session.post("/v1/completions", json={**long, "stream": True}))
            await asyncio.sleep(0.2)
            queued.cancel()  # the client goes away while its request waits behind at least one round
            responses = await asyncio.gather(*holders)
            assert [r.status_code for r in responses] == [200] * 10

    asyncio.run(scenario())
    after = _wait_for_idle_engine(client)
    # The holders' 10 sequences started and ran to the end; the one whose client left never got a slot.
    assert after["first_tokens"] - before["first_tokens"] == 10, after
    assert after["generated_tokens"] - before["generated_tokens"] == 10 * 240


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_overload_gets_429_with_retry_after_from_limits_given_as_user_config(client, base_url, model_dir):
    # Serve hands user_config to reconfigure(): no waiting room past the 4 slots. (`serve deploy` of a
    # changed user_config reconfigures running replicas in place; serve.run from Python replaces them.)
    # Later tests in this module run with this setting.
    _deploy_main(model_dir, user_config={"max_waiting": 0})

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as session:
            body = {"prompt": "flood", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(session.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 4, "the batch (4 slots) should be full before anyone is refused"
    refused = next(r for r in responses if r.status_code == 429)
    # Computed from the engine's drain rate (engine/admission.py), in whole seconds.
    assert 1 <= int(refused.headers["Retry-After"]) <= 30
    assert refused.json()["error"]["type"] == "rate_limit_error"


def test_a_killed_replica_is_replaced_and_serving_resumes(client):
    import ray

    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{APP}#GPT2Server#")
    ]
    old_replica = engine_stats(client)["ingress"]["replica"]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def served_by_a_new_replica() -> bool:
        try:
            stats = client.get("/v1/engine/stats", timeout=5)
            ok = client.post("/v1/completions", json={"prompt": "back?", "max_tokens": 2}, timeout=5)
        except httpx.HTTPError:
            return False
        new = stats.status_code == 200 and stats.json()["ingress"]["replica"] != old_replica
        return new and ok.status_code == 200

    assert wait_until(served_by_a_new_replica, timeout_s=90, interval_s=0.5)


def test_the_autoscaling_policy_leaves_out_requests_still_sending_their_bodies():
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from gpt2_platform.serve.autoscaling import BODIES_IN_FLIGHT, working_requests_policy

    def desired(total_num_requests: float, reading: dict[str, float]) -> float:
        ctx = AutoscalingContext(
            deployment_id=None,
            deployment_name="GPT2Server",
            app_name=APP,
            current_num_replicas=2,
            target_num_replicas=2,
            running_replicas=[],
            total_num_requests=total_num_requests,
            total_queued_requests=0,
            aggregated_metrics={BODIES_IN_FLIGHT: reading},
            raw_metrics={},
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8,
            policy_state={},
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=None,
            config=AutoscalingConfig(target_ongoing_requests=10),
        )
        return working_requests_policy(ctx)[0]

    assert desired(40, {}) == 4  # nothing reading: Serve's own rule, requests / target
    assert desired(140, {"r1": 70, "r2": 70}) == 0  # slow clients alone: no load at all
    assert desired(150, {"r1": 100}) == 5


async def hold_streaming_load(url: str, num_streams: int, stop: asyncio.Event) -> None:
    """Keep `num_streams` long streaming completions in flight until `stop` is set."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as session:

        async def one_stream() -> None:
            while not stop.is_set():
                body = {"prompt": "load", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with session.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

        await asyncio.gather(*(one_stream() for _ in range(num_streams)))


# Short look-back windows and metrics intervals are what make this test fast; Serve marks metrics_interval_s
# deprecated (for environment variables that Ray 2.60 does not read yet).
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(base_url, model_dir):
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 2,
        "look_back_period_s": 2,
        # How often replicas and handles push these metrics to the controller (10 s by default, longer than
        # the look-back itself): each scaling decision waits for a push.
        "metrics_interval_s": 0.5,
        # Ours: Serve's count less the bodies still arriving (none here), so it scales as Serve's would.
        "policy": {"policy_function": "gpt2_platform.serve.autoscaling:working_requests_policy"},
    }
    # gpu_monitor: the replicas start the GPU exporters themselves (here they report "no GPU").
    args = {
        "model": str(model_dir),
        "engine": {"dtype": "fp32", "max_batch_size": 2},
        "limits": {"max_waiting": 8},
        "gpu_monitor": True,
    }
    # The engine scales on the sequences it reports (they come over the token link, not as Serve calls).
    engine_autoscaling = {
        **autoscaling,
        "policy": {"policy_function": "gpt2_platform.serve.autoscaling:sequences_policy"},
    }
    app = gpt2_deployment(
        args,
        engine_options={**ENGINE_OPTIONS, "autoscaling_config": engine_autoscaling},
        autoscaling_config=autoscaling,
        max_ongoing_requests=8,
        ray_actor_options={"num_cpus": 0.5},
        **FAST_DRAIN,
    )
    serve.run(app, name="autoscale", route_prefix="/autoscale")

    def running_replicas(deployment: str = "GPT2Server") -> int:
        return serve.status().applications["autoscale"].deployments[deployment].replica_states.get("RUNNING", 0)

    def both_scaled(count: int) -> bool:
        return running_replicas() == count and running_replicas("GPT2Engine") == count

    async def scale_up() -> bool:
        stop = asyncio.Event()
        load = asyncio.create_task(hold_streaming_load(f"{base_url}/autoscale", 3, stop))
        deadline = time.monotonic() + 60
        while not both_scaled(2) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        stop.set()
        await load
        return both_scaled(2)

    try:
        assert both_scaled(1)
        # A new ingress replica has its token link up before its first request (which would otherwise go
        # as a Serve call, milliseconds of the engine replica's time).
        with httpx.Client(base_url=f"{base_url}/autoscale", timeout=10) as plain:
            assert wait_until(lambda: engine_stats(plain)["ingress"]["links"] >= 1, timeout_s=15), "no link yet"
        assert asyncio.run(scale_up()), f"no second replica under load: {running_replicas()} ingress, " + (
            f"{running_replicas('GPT2Engine')} engine"
        )
        assert wait_until(lambda: both_scaled(1), timeout_s=60, interval_s=0.5), "no scale-down"
        assert len(exporter.exporter_names()) == 1  # one per node, however many replicas started it
    finally:
        serve.delete("autoscale")
        exporter.stop_exporters()


def test_lm_evaluation_harness_scores_the_served_model_as_its_hf_backend_does(
    base_url, model_dir, tmp_path, monkeypatch
):
    # A real evaluation client: lm-evaluation-harness's local-completions (echo + logprobs over HTTP) on a
    # small multiple-choice task made here (the sums in the demo stories), against its own hf backend
    # on the same checkpoint. Same accuracy, and the same log-likelihood for every choice.
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    rows = []
    for i, story in enumerate(demo_data.stories(12, seed=11)):
        head, _, tail = story.rpartition(" has ")  # "... now erin has" | "10 stones."
        total, noun = tail.split(" ", 1)
        options = [int(total) + d for d in (0, 1, -1, 2)]
        choices = [f" {n} {noun}" for n in options[i % 4 :] + options[: i % 4]]
        rows.append({"context": head + " has", "choices": choices, "label": (-i) % 4})
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "sums.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "story_sums",
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test",
                "output_type": "multiple_choice",
                "doc_to_text": "{{context}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}",
                "metric_list": [{"metric": "acc"}],
            }
        )  # fmt: skip
    )
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # no indexing of its ~10K built-in tasks
    common = {"tasks": ["story_sums"], "task_manager": tasks, "log_samples": True, "random_seed": 0}
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={base_url}/v1/completions,model={MODEL_NAME},tokenizer={model_dir},"
        "tokenizer_backend=huggingface,max_length=256,num_concurrent=1,max_retries=1",
        **common,
    )
    local = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model_dir},dtype=float32", device="cpu", **common
    )
    assert served["results"]["story_sums"]["acc,none"] == local["results"]["story_sums"]["acc,none"]

    def loglikelihoods(result: dict) -> list[float]:
        samples = sorted(result["samples"]["story_sums"], key=lambda s: s["doc_id"])
        return [resp[0][0] for sample in samples for resp in sample["resps"]]

    assert len(loglikelihoods(served)) == 4 * len(rows)
    assert loglikelihoods(served) == pytest.approx(loglikelihoods(local), abs=1e-4)
