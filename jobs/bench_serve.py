"""Load-test a running Serve app: sweep client concurrency, report throughput and latency.

    serve run deployments/gpt2.yaml &                         # or any URL serving /v1/completions
    python jobs/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 4 16 64 --json-out serve.json
    python jobs/bench_serve.py --start-preset gpt2 --concurrency 1 16 64 256   # starts its own app on the local Ray

Each level keeps `concurrency` streaming requests in flight until `--requests`
have finished. Every request has the same prompt length (token ids, so the
length is exact whatever the tokenizer) and generates exactly `--max-tokens`
tokens (ignore_eos). Reported per level: requests/s, generated tokens/s, time to
first token (first streamed chunk) p50/p99, time per output token after the
first p50/p99, and how many requests failed (429s included). Against --url it
needs only httpx; --start-preset needs the package and Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
import urllib.parse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

# Printable ASCII ids: single-byte tokens in GPT-2's BPE and in the byte tokenizer alike.
_FIRST_ID, _NUM_IDS = 32, 95


@dataclass
class RequestResult:
    ok: bool
    status: int
    ttft_s: float = 0.0
    total_s: float = 0.0
    completion_tokens: int = 0


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    seconds: float
    requests_per_s: float
    generated_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_token_p50_ms: float
    per_token_p99_ms: float
    client_cpu_pct: float
    """The busiest client process's CPU time over the level's wall time: near 100, the load generator,
    not the server, sets the pace (use --client-processes)."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def prompt_ids(length: int, index: int) -> list[int]:
    """A prompt of exactly `length` token ids, different per request (no prefix caching to exploit)."""
    return [_FIRST_ID + (index * 7 + position * 13) % _NUM_IDS for position in range(length)]


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    """Stream one completion; time its first chunk and its end, count its tokens from the usage chunk."""
    started = time.perf_counter()
    first_chunk_at, completion_tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestResult(ok=False, status=response.status_code)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return RequestResult(ok=False, status=response.status_code)
            if chunk["choices"] and first_chunk_at is None:
                first_chunk_at = time.perf_counter()
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    ended = time.perf_counter()
    if first_chunk_at is None:
        return RequestResult(ok=False, status=response.status_code)
    return RequestResult(True, 200, first_chunk_at - started, ended - started, completion_tokens)


async def run_requests(
    client: httpx.AsyncClient, base_body: dict, concurrency: int, indices: range, prompt_len: int
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
                results.append(await one_request(client, body))
            except httpx.HTTPError:
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


def run_share(share: ClientShare) -> tuple[list[RequestResult], float, float]:
    """Run one share on its own event loop: its results, its CPU seconds, and time.time() at its end."""

    async def run() -> tuple[list[RequestResult], float, float]:
        limits = httpx.Limits(max_connections=share.concurrency + 4, max_keepalive_connections=share.concurrency)
        async with httpx.AsyncClient(
            base_url=share.url, headers=share.headers, timeout=share.timeout_s, limits=limits
        ) as client:
            await asyncio.sleep(max(0.0, share.start_at - time.time()))
            cpu = time.process_time()
            results = await run_requests(client, share.base_body, share.concurrency, share.indices, share.prompt_len)
            return results, time.process_time() - cpu, time.time()

    return asyncio.run(run())


def run_level(
    pool: ProcessPoolExecutor | None, args: argparse.Namespace, headers: dict, base_body: dict, concurrency: int
) -> LevelResult:
    """Keep `concurrency` requests in flight, over the client processes, until the level's requests finished.

    One Python process parsing every SSE chunk can become the bottleneck of the measurement itself
    (httpx spends tens of microseconds a chunk); `--client-processes` splits the load, and every
    level reports how busy its busiest client process was.
    """
    num_requests = args.requests or max(8, 4 * concurrency)
    processes = min(args.client_processes, concurrency)
    start_at = time.time() + (2.0 if pool is not None else 0.0)  # every process connected and waiting
    shares = [
        ClientShare(
            args.url,
            headers,
            args.timeout_s,
            base_body,
            len(range(i, concurrency, processes)),
            range(i, num_requests, processes),
            args.prompt_tokens,
            start_at,
        )
        for i in range(processes)
    ]
    if pool is None:
        outcomes = [run_share(shares[0])]
    else:
        outcomes = list(pool.map(run_share, shares))
    seconds = max(end for _, _, end in outcomes) - start_at
    results = [r for share_results, _, _ in outcomes for r in share_results]
    busiest = max(cpu for _, cpu, _ in outcomes)
    return summarise(concurrency, results, seconds, 100.0 * busiest / seconds)


def summarise(concurrency: int, results: list[RequestResult], seconds: float, client_cpu_pct: float) -> LevelResult:
    done = [r for r in results if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in done]
    per_token_ms = [(r.total_s - r.ttft_s) / (r.completion_tokens - 1) * 1e3 for r in done if r.completion_tokens > 1]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(done),
        seconds=seconds,
        requests_per_s=len(done) / seconds,
        generated_tokens_per_s=sum(r.completion_tokens for r in done) / seconds,
        ttft_p50_ms=percentile(ttft_ms, 50),
        ttft_p99_ms=percentile(ttft_ms, 99),
        per_token_p50_ms=percentile(per_token_ms, 50),
        per_token_p99_ms=percentile(per_token_ms, 99),
        client_cpu_pct=client_cpu_pct,
    )


def as_markdown(levels: list[LevelResult]) -> str:
    lines = [
        "| concurrency | requests (failed) | requests/s | generated tokens/s | TTFT p50 / p99 ms "
        "| per token p50 / p99 ms | client CPU % |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        lines.append(
            f"| {level.concurrency} | {level.requests} ({level.failed}) | {level.requests_per_s:.2f} "
            f"| {level.generated_tokens_per_s:.0f} | {level.ttft_p50_ms:.1f} / {level.ttft_p99_ms:.1f} "
            f"| {level.per_token_p50_ms:.2f} / {level.per_token_p99_ms:.2f} | {level.client_cpu_pct:.0f} |"
        )
    return "\n".join(lines)


def sweep(args: argparse.Namespace) -> tuple[str, list[LevelResult]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout_s) as client:
        models = client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
    base_body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    warm = ClientShare(args.url, headers, args.timeout_s, base_body, 1, range(2), args.prompt_tokens, 0.0)
    run_share(warm)  # warm the replica
    levels = []
    pool = None
    if args.client_processes > 1:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("spawn"))
    try:
        for concurrency in args.concurrency:
            levels.append(run_level(pool, args, headers, base_body, concurrency))
            print(as_markdown(levels[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            if levels[-1].client_cpu_pct > 85:
                print(
                    f"warning: a client process was {levels[-1].client_cpu_pct:.0f}% busy at concurrency "
                    f"{concurrency}; the load generator may be what limits this level (try --client-processes)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if pool is not None:
            pool.shutdown()
    with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout_s) as client:
        stats = client.get("/v1/engine/stats")  # how the replica actually batched (our app only)
        if stats.status_code == 200:
            print(f"engine stats: {stats.json()}", file=sys.stderr, flush=True)
    return model, levels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=None, help="per level; default max(8, 4 x concurrency)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=os.environ.get("GPT2_API_KEY"), help="default: $GPT2_API_KEY")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--client-processes", type=int, default=1, help="split each level's requests over this many client processes"
    )
    parser.add_argument("--json-out", type=Path)
    started = parser.add_argument_group("a local app started by this script (fresh weights, byte tokenizer)")
    started.add_argument("--start-preset", help="e.g. gpt2: deploy this preset first, on a GPU if there is one")
    started.add_argument("--max-batch-size", type=int, default=256)
    started.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the engine's decode step (default: the app's own default, on GPUs only)",
    )
    started.add_argument(
        "--stream-interval-ms", type=float, default=20.0, help="limits.stream_interval_ms (0: every token)"
    )
    started.add_argument(
        "--engine-process", action="store_true", help="args.engine_process: the engine in a child process"
    )
    args = parser.parse_args()
    app = None
    if args.start_preset:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))
        from gpt2_platform.bench import serve_app

        port = urllib.parse.urlsplit(args.url).port or 8000
        model_dir = Path("runs") / f"bench-serve-{args.start_preset}"
        max_seq_len = args.prompt_tokens + args.max_tokens
        app = serve_app.start(
            args.start_preset,
            model_dir,
            port,
            args.max_batch_size,
            max_seq_len,
            args.compile,
            stream_interval_ms=args.stream_interval_ms,
            engine_process=args.engine_process,
        )
        print(f"replica ready in {app['replica_ready_s']:.1f} s on {app['num_gpus']} GPU(s)", flush=True)
    try:
        model, levels = sweep(args)
    finally:
        if app is not None:
            serve_app.stop()
    print(f"{model} at {args.url}: {args.prompt_tokens} prompt + {args.max_tokens} generated tokens per request")
    print(as_markdown(levels))
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json_out")}
        report = {"model": model, "config": config, "app": app, "levels": [asdict(level) for level in levels]}
        args.json_out.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
