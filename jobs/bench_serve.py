"""Load-test a running Serve app: sweep client concurrency, report throughput and latency.

    serve run deployments/gpt2.yaml &                         # or any URL serving /v1/completions
    python jobs/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 4 16 64 --json-out serve.json
    python jobs/bench_serve.py --start-preset gpt2 --concurrency 1 16 64 256 --mode both --json-out serve.json
    python jobs/bench_serve.py --plot-from serve.json --plot-out serve.png   # draw the chart later

Each level keeps `concurrency` requests in flight until `--requests` have finished
(gpt2_platform.bench.load says how they are built and timed, load_report how they are
shown). Reported per level and mode (--mode stream, nonstream or both): requests/s,
generated tokens/s, time to first
token p50/p99 (streaming: the first chunk; non-streaming: the whole request), latency
p50/p99, time per output token after the first, failures (429s included), and which
processes on the machine used the CPU. With --start-preset the engine is first run alone
on the same model and shapes at batch size = each concurrency (in a child process, so its
GPU memory is free again before Serve starts), and each level shows HTTP / engine tokens/s.
Against --url it needs only httpx; --start-preset needs the package and Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.parse
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.bench import load, load_report  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402

logger = logging.getLogger("bench_serve")


def start_app(args: argparse.Namespace) -> dict:
    from gpt2_platform.bench import serve_app

    port = urllib.parse.urlsplit(args.url).port or 8000
    model_dir = Path("runs") / f"bench-serve-{args.start_preset}"
    max_seq_len = args.prompt_tokens + args.max_tokens
    return serve_app.start(
        args.start_preset,
        model_dir,
        port,
        args.max_batch_size,
        max_seq_len,
        args.compile,
        stream_interval_ms=args.stream_interval_ms,
        ingress_replicas=args.ingress_replicas,
        ingress=args.ingress,
        compile_cache_dir=args.compile_cache_dir,
    )


def print_level(level: load.LevelResult) -> None:
    print("\n".join(load_report.level_lines(level)), file=sys.stderr, flush=True)


def write_plot(report: dict, path: Path, json_path: Path | None) -> None:
    if load_report.plot(report, path) is not None:
        print(f"wrote {path}")
        return
    later = f"python jobs/bench_serve.py --plot-from {json_path or 'serve.json'} --plot-out {path}"
    print(f"matplotlib is not installed: skipped {path} (pip install matplotlib, then: {later})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=None, help="per level; default max(32, 4 x concurrency)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=os.environ.get("GPT2_API_KEY"), help="default: $GPT2_API_KEY")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--client-processes", type=int, default=1, help="split each level's requests over this many client processes"
    )
    parser.add_argument(
        "--mode",
        choices=["stream", "nonstream", "both"],
        default="stream",
        help="streamed (SSE) or whole-response requests; both runs each level twice",
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--plot-out", type=Path, help="PNG chart (default: beside --json-out, if given)")
    parser.add_argument(
        "--plot-from", type=Path, help="draw --plot-out from a report this script wrote, and run nothing else"
    )
    started = parser.add_argument_group("a local app started by this script (fresh weights, byte tokenizer)")
    started.add_argument("--start-preset", help="e.g. gpt2: deploy this preset first, on a GPU if there is one")
    started.add_argument("--max-batch-size", type=int, default=256)
    started.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the engine's decode step (default: the engine's own, engine.default_compile)",
    )
    started.add_argument(
        "--stream-interval-ms", type=float, default=20.0, help="limits.stream_interval_ms (0: every token)"
    )
    started.add_argument(
        "--ingress-replicas", type=int, default=1, help="GPT2Server (HTTP) replicas in front of the one engine"
    )
    started.add_argument(
        "--ingress",
        choices=["proxy", "direct", "haproxy"],
        default="proxy",
        help="how HTTP reaches the ingress replicas: Serve's Python proxy (default), direct ingress (one "
        "replica serves the port), or HAProxy balancing every replica (RAY_SERVE_ENABLE_HA_PROXY)",
    )
    started.add_argument(
        "--compile-cache-dir",
        help="engine.compile_cache_dir: keep Triton's and torch.compile's caches here (a cold start with this "
        "directory carried over from another machine finds its kernels compiled)",
    )
    started.add_argument(
        "--engine-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the engine alone at batch size = each concurrency (--no-engine-baseline skips it)",
    )
    args = parser.parse_args()
    if args.plot_from and not args.plot_out:
        args.plot_out = args.plot_from.with_suffix(".png")
    if args.plot_out is None and args.json_out is not None:
        args.plot_out = args.json_out.with_suffix(".png")
    return args


def main() -> int:
    args = parse_args()
    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.plot_from:
        write_plot(json.loads(args.plot_from.read_text()), args.plot_out, args.plot_from)
        return 0
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    settings = load.LoadSettings(
        url=args.url,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        headers=headers,
        timeout_s=args.timeout_s,
        num_requests=args.requests,
        client_processes=args.client_processes,
    )
    modes = list(load.MODES) if args.mode == "both" else [args.mode]
    baseline, app = None, None
    if args.start_preset and args.engine_baseline:
        baseline = load.engine_baseline(
            args.start_preset,
            args.concurrency,
            args.prompt_tokens,
            args.max_tokens,
            args.max_batch_size,
            args.compile,
            args.temperature,
        )
        print(f"engine alone: {[(r['batch_size'], round(r['tokens_per_s'])) for r in baseline['rows']]} tokens/s")
    if args.start_preset:
        app = start_app(args)
        print(
            f"replica ready in {app['replica_ready_s']:.1f} s on {app['num_gpus']} GPU(s) (Serve's status RUNNING; "
            f"serve.run, which looks once a second, returned at {app['serve_run_s']:.1f} s)",
            flush=True,
        )
    try:
        model = load.discover_model(settings)
        print("\n".join(load_report.markdown_header(with_engine=False)), file=sys.stderr, flush=True)
        levels = load.sweep(settings, args.concurrency, modes, model, on_level=print_level)
        stats = load.engine_stats(settings)  # how the replica actually batched (our app only)
        if stats is not None:
            print(f"engine stats: {stats}", file=sys.stderr, flush=True)
    finally:
        if app is not None:
            from gpt2_platform.bench import serve_app

            serve_app.stop()
    if baseline is not None:
        load.attach_engine_baseline(levels, {r["batch_size"]: r["tokens_per_s"] for r in baseline["rows"]})
    print(f"{model} at {args.url}: {args.prompt_tokens} prompt + {args.max_tokens} generated tokens per request")
    print(load_report.as_markdown(levels))
    comparison = load_report.engine_comparison_lines(levels)
    if comparison:
        print("\n".join(comparison))
    excluded = ("api_key", "json_out", "plot_out", "plot_from")
    config = {k: v for k, v in vars(args).items() if k not in excluded}
    report = {
        "model": model,
        "config": config,
        "app": app,
        "engine_baseline": baseline,
        "levels": [asdict(level) for level in levels],
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2, default=str))
    if args.plot_out:
        write_plot(report, args.plot_out, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
