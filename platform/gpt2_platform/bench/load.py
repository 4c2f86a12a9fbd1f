"""The serving benchmark's load generator: keep N completions in flight, measure what comes back.

Every request has the same prompt length (token ids, so the length is exact whatever the
tokenizer) and generates exactly `max_tokens` tokens (ignore_eos). A streaming request's time to
first token is its first chunk; a non-streaming request's first token arrives with its last, so
its TTFT is its whole latency. A 429 is retried after its Retry-After (as the openai client does) while
that stays within `retry_429_within_s`, and counts as failed past it. The requests go through aiohttp,
whose C parser keeps a client process far from being the bottleneck at a thousand streams; httpx serves
the few control calls. psutil (optional) gives the process CPU line; the engine-alone baseline, for a
local app only, needs torch. load_report.py formats the results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import httpx

from gpt2_platform.bench import processes

logger = logging.getLogger(__name__)

# Printable ASCII ids: single-byte tokens in GPT-2's BPE and in the byte tokenizer alike.
_FIRST_ID, _NUM_IDS = 32, 95
MODES = ("stream", "nonstream")


@dataclass
class RequestResult:
    ok: bool
    status: int
    """The HTTP status; 0 when the connection failed, 200 for a stream that broke with an error chunk."""
    ttft_s: float = 0.0
    total_s: float = 0.0
    completion_tokens: int = 0
    retries: int = 0
    """429s retried after their Retry-After before this result."""


@dataclass
class LevelResult:
    mode: str
    """stream or nonstream."""
    concurrency: int
    requests: int
    failed: int
    seconds: float
    requests_per_s: float
    generated_tokens_per_s: float
    ttft_p50_ms: float
    """Streaming: the first chunk. Non-streaming: the whole request (equal to latency_p50_ms)."""
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    per_token_p50_ms: float
    """Time per output token after the first (streaming only; NaN otherwise)."""
    per_token_p99_ms: float
    client_cpu_pct: float
    """The busiest client process's CPU time over the level's wall time: near 100, the load generator,
    not the server, sets the pace (use more client processes)."""
    failed_by_status: dict[str, int] = field(default_factory=dict)
    retried_429: int = 0
    """429s that were retried after their Retry-After (the request then counts by its last try)."""
    process_cpu: dict | None = None
    """processes.cpu_shares over the level: the top processes' CPU % of one core."""
    engine_tokens_per_s: float | None = None
    """The engine alone at batch size = concurrency, same model and shapes (when measured)."""
    http_to_engine_ratio: float | None = None
    engine_split: dict | None = None
    """What the engine's own counters saw over the level (`engine_split`); None for another server."""


@dataclass(frozen=True)
class LoadSettings:
    """What every level of a sweep shares."""

    url: str
    prompt_tokens: int = 128
    max_tokens: int = 128
    temperature: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    num_requests: int | None = None
    """Per level; None: max(32, 4 x concurrency) (enough at one stream for its percentiles to mean something)."""
    client_processes: int = 1
    """Split each level's requests over this many spawned client processes (1: in this process)."""
    retry_429_within_s: float = 30.0
    """Retry a 429 after its Retry-After while the retry starts within this many seconds of the first try
    (0: a 429 fails at once)."""

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "max_tokens", "client_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def prompt_ids(length: int, index: int) -> list[int]:
    """A prompt of exactly `length` token ids, different per request (no prefix caching to exploit)."""
    return [_FIRST_ID + (index * 7 + position * 13) % _NUM_IDS for position in range(length)]


def request_body(settings: LoadSettings, model: str, mode: str) -> dict:
    """The body every request of a level shares (the prompt is added per request)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    body = {
        "model": model,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "ignore_eos": True,
        "stream": mode == "stream",
    }
    if mode == "stream":
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(session: aiohttp.ClientSession, body: dict, retry_429_within_s: float) -> RequestResult:
    """One completion, streamed or not as `body` says. A 429 is retried after its Retry-After, as the
    openai client does, while the retry would still start within `retry_429_within_s` of the first try;
    the result then counts the retries and its times run from the first try."""
    started = time.perf_counter()
    retries = 0
    while True:
        result, retry_after_s = await _one_try(session, body, started)
        waited = time.perf_counter() - started
        if result.status != 429 or retry_after_s is None or waited + retry_after_s > retry_429_within_s:
            result.retries = retries
            return result
        retries += 1
        await asyncio.sleep(retry_after_s)


async def _one_try(session: aiohttp.ClientSession, body: dict, started: float) -> tuple[RequestResult, float | None]:
    """One try; its times count from `started`. Also the refusal's Retry-After (seconds), when it had one."""
    async with session.post("/v1/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            retry_after = response.headers.get("Retry-After")
            return RequestResult(ok=False, status=response.status), _seconds(retry_after)
        if not body.get("stream"):
            try:
                payload = await response.json()
                completion_tokens = payload["usage"]["completion_tokens"]
                assert payload["choices"], "a 200 completion without choices"
            except (ValueError, KeyError, TypeError, AssertionError, aiohttp.ContentTypeError):
                return RequestResult(ok=False, status=response.status), None
            ended = time.perf_counter()
            return RequestResult(True, 200, ended - started, ended - started, completion_tokens), None
        # aiohttp splits the body at newlines in C; an SSE event is one `data: ...` line and a blank one.
        first_chunk_at, completion_tokens = None, 0
        async for raw in response.content:
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(raw[len(b"data: ") :])
            if "error" in chunk:
                return RequestResult(ok=False, status=response.status), None
            if chunk["choices"] and first_chunk_at is None:
                first_chunk_at = time.perf_counter()
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    ended = time.perf_counter()
    if first_chunk_at is None:
        return RequestResult(ok=False, status=200), None
    return RequestResult(True, 200, first_chunk_at - started, ended - started, completion_tokens), None


def _seconds(retry_after: str | None) -> float | None:
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:  # an HTTP date: not what this project's servers send
        return None


async def run_requests(
    session: aiohttp.ClientSession,
    base_body: dict,
    concurrency: int,
    indices: range,
    prompt_len: int,
    retry_429_within_s: float,
) -> list[RequestResult]:
    """Keep `concurrency` requests in flight until the requests of `indices` finished."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in indices:
        queue.put_nowait(index)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            body = {**base_body, "prompt": prompt_ids(prompt_len, index)}
            try:
                results.append(await one_request(session, body, retry_429_within_s))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                results.append(RequestResult(ok=False, status=0))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


@dataclass(frozen=True)
class ClientShare:
    """One client process's part of a level (picklable: it crosses to a spawned process)."""

    url: str
    headers: dict
    timeout_s: float
    base_body: dict
    concurrency: int
    indices: range
    prompt_len: int
    start_at: float
    """time.time() at which every client process starts its requests."""
    retry_429_within_s: float = 0.0


def run_share(share: ClientShare) -> tuple[list[RequestResult], float, float]:
    """Run one share on its own event loop: its results, its CPU seconds, and time.time() at its end."""

    async def run() -> tuple[list[RequestResult], float, float]:
        connector = aiohttp.TCPConnector(limit=share.concurrency + 4)
        timeout = aiohttp.ClientTimeout(total=share.timeout_s)
        async with aiohttp.ClientSession(
            base_url=share.url, headers=share.headers, timeout=timeout, connector=connector
        ) as session:
            await asyncio.sleep(max(0.0, share.start_at - time.time()))
            cpu = time.process_time()
            results = await run_requests(
                session, share.base_body, share.concurrency, share.indices, share.prompt_len, share.retry_429_within_s
            )
            return results, time.process_time() - cpu, time.time()

    return asyncio.run(run())


def run_level(
    pool: ProcessPoolExecutor | None, settings: LoadSettings, base_body: dict, concurrency: int
) -> LevelResult:
    """Keep `concurrency` requests in flight, over the client processes, until the level's requests finished.

    One Python process parsing every SSE chunk can become the bottleneck of the measurement itself
    (tens of microseconds a chunk); client processes split the load, and every level
    reports how busy its busiest client process was and which processes on the machine used the CPU.
    """
    num_requests = settings.num_requests or max(32, 4 * concurrency)
    num_processes = min(settings.client_processes, concurrency) if pool is not None else 1
    start_at = time.time() + (2.0 if pool is not None else 0.0)  # every process connected and waiting
    shares = [
        ClientShare(
            settings.url,
            settings.headers,
            settings.timeout_s,
            base_body,
            len(range(i, concurrency, num_processes)),
            range(i, num_requests, num_processes),
            settings.prompt_tokens,
            start_at,
            settings.retry_429_within_s,
        )
        for i in range(num_processes)
    ]
    if pool is None:
        before = processes.snapshot()
        outcomes = [run_share(shares[0])]
    else:
        futures = [pool.submit(run_share, share) for share in shares]
        time.sleep(max(0.0, start_at - time.time()))  # the processes' CPU counts from when they start
        before = processes.snapshot()
        outcomes = [future.result() for future in futures]
    shares_cpu = processes.cpu_shares(before, processes.snapshot())
    seconds = max(end for _, _, end in outcomes) - start_at
    results = [r for share_results, _, _ in outcomes for r in share_results]
    busiest = max(cpu for _, cpu, _ in outcomes)
    level = summarise(base_body, concurrency, results, seconds, 100.0 * busiest / seconds)
    level.process_cpu = shares_cpu
    return level


def summarise(
    base_body: dict, concurrency: int, results: list[RequestResult], seconds: float, client_cpu_pct: float
) -> LevelResult:
    done = [r for r in results if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in done]
    latency_ms = [r.total_s * 1e3 for r in done]
    per_token_ms = [(r.total_s - r.ttft_s) / (r.completion_tokens - 1) * 1e3 for r in done if r.completion_tokens > 1]
    streaming = bool(base_body.get("stream"))
    if not streaming:
        per_token_ms = []  # no chunk before the last: there is no time between tokens to measure
    failed = Counter(str(r.status) for r in results if not r.ok)
    return LevelResult(
        mode="stream" if streaming else "nonstream",
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(done),
        seconds=seconds,
        requests_per_s=len(done) / seconds,
        generated_tokens_per_s=sum(r.completion_tokens for r in done) / seconds,
        ttft_p50_ms=percentile(ttft_ms, 50),
        ttft_p99_ms=percentile(ttft_ms, 99),
        latency_p50_ms=percentile(latency_ms, 50),
        latency_p99_ms=percentile(latency_ms, 99),
        per_token_p50_ms=percentile(per_token_ms, 50),
        per_token_p99_ms=percentile(per_token_ms, 99),
        client_cpu_pct=client_cpu_pct,
        failed_by_status=dict(sorted(failed.items())),
        retried_429=sum(r.retries for r in results),
    )


def engine_baseline(
    preset_name: str,
    concurrency_levels: list[int],
    prompt_tokens: int,
    max_tokens: int,
    max_batch_size: int | Literal["auto"],
    compile_step: bool | None,
    temperature: float,
) -> dict:
    """The engine alone at batch size = each concurrency level, in a spawned process that exits
    (and gives its GPU memory back) before the Serve app starts."""
    import multiprocessing

    import torch

    from gpt2_platform.bench import generation

    if temperature > 0:
        logger.warning("the engine baseline decodes greedily; the HTTP requests sample at temperature %g", temperature)
    on_gpu = torch.cuda.is_available()
    runs = 3 if on_gpu else 1  # on a CPU one run of each batch size is already the longest step
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        rows = pool.submit(
            generation.engine_only,
            preset_name,
            sorted(set(concurrency_levels)),
            prompt_tokens,
            max_tokens,
            max_batch_size,
            "auto",
            compile_step,
            runs,
        ).result()
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    return {"device": device, "runs": runs, "greedy": True, "rows": rows}


def attach_engine_baseline(levels: list[LevelResult], engine_tokens_per_s: dict[int, float]) -> None:
    """Set each level's engine tokens/s (at batch size = its concurrency) and HTTP / engine."""
    for level in levels:
        engine = engine_tokens_per_s.get(level.concurrency)
        if engine:
            level.engine_tokens_per_s = engine
            level.http_to_engine_ratio = level.generated_tokens_per_s / engine


def engine_stats(settings: LoadSettings) -> dict | None:
    """The engine's counters through our app's /v1/engine/stats (None from a server that has none)."""
    with httpx.Client(base_url=settings.url, headers=settings.headers, timeout=settings.timeout_s) as client:
        response = client.get("/v1/engine/stats")
    return response.json() if response.status_code == 200 else None


def engine_split(before: dict | None, after: dict | None) -> dict | None:
    """Per level, from the engine's counters before and after it: how it batched, and where the time to a
    first token went inside the engine (mean ms waiting for a slot, then from admission to the first
    token taken in). The rest of a client's TTFT is HTTP, the ingress and the token link."""
    keys = ("steps", "generated_tokens", "first_tokens", "queue_s", "first_token_s")
    if before is None or after is None or any(k not in before or k not in after for k in keys):
        return None
    delta = {k: after[k] - before[k] for k in keys}
    firsts = delta["first_tokens"]
    split = {
        "steps": delta["steps"],
        "tokens_per_step": delta["generated_tokens"] / delta["steps"] if delta["steps"] else math.nan,
        "queue_ms": 1e3 * delta["queue_s"] / firsts if firsts else math.nan,
        "admission_to_first_token_ms": 1e3 * delta["first_token_s"] / firsts if firsts else math.nan,
    }
    # Full collections (generation 2) in the engine's process over the level, and in the ingress replica
    # that answered since its start (another replica may have answered before the level).
    if "gc_count" in before and "gc_count" in after:
        split["engine_full_gcs"] = after["gc_count"][2] - before["gc_count"][2]
        split["engine_full_gc_ms"] = 1e3 * (after["gc_s"][2] - before["gc_s"][2])
    ingress = after.get("ingress", {})
    if "gc_count" in ingress:
        split["ingress_full_gcs_since_start"] = ingress["gc_count"][2]
        split["ingress_longest_full_gc_ms"] = 1e3 * ingress["gc_longest_s"][2]
    return split


def discover_model(settings: LoadSettings) -> str:
    with httpx.Client(base_url=settings.url, headers=settings.headers, timeout=settings.timeout_s) as client:
        models = client.get("/v1/models")
        models.raise_for_status()
        return models.json()["data"][0]["id"]


def sweep(
    settings: LoadSettings,
    concurrency_levels: list[int],
    modes: list[str],
    model: str,
    on_level: Callable[[LevelResult], None] | None = None,
) -> list[LevelResult]:
    """Every level in every mode (each concurrency's modes back to back, so they see the same server)."""
    bodies = {mode: request_body(settings, model, mode) for mode in modes}
    for body in bodies.values():  # warm the server in each mode
        share = ClientShare(
            settings.url, settings.headers, settings.timeout_s, body, 1, range(2), settings.prompt_tokens, 0.0, 30.0
        )
        run_share(share)
    pool = None
    if settings.client_processes > 1:
        import multiprocessing

        pool = ProcessPoolExecutor(settings.client_processes, mp_context=multiprocessing.get_context("spawn"))
    levels = []
    try:
        for concurrency in concurrency_levels:
            for mode in modes:
                before = engine_stats(settings)
                level = run_level(pool, settings, bodies[mode], concurrency)
                level.engine_split = engine_split(before, engine_stats(settings))
                levels.append(level)
                if level.client_cpu_pct > 85:
                    logger.warning(
                        "a client process was %.0f%% busy at concurrency %d (%s): the load generator may be "
                        "what limits this level (use more client processes)",
                        level.client_cpu_pct,
                        concurrency,
                        mode,
                    )
                if on_level is not None:
                    on_level(level)
    finally:
        if pool is not None:
            pool.shutdown()
    return levels
