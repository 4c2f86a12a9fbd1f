"""Load-test a running Serve app: sweep client concurrency, report throughput and latency.

    serve run deployments/gpt2.yaml &                         # or any URL serving /v1/completions
    python jobs/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 4 16 64 --json-out serve.json
    python jobs/bench_serve.py --config deployments/gpt2-cluster.yaml --model runs/x/model --concurrency 1 256
    python jobs/bench_serve.py --start-preset gpt2 --concurrency 1 64 256 512 1024 --mode both --json-out serve.json
    python jobs/bench_serve.py --plot-from serve.json --plot-out serve.png   # draw the chart later

--config deploys a Serve config file as it ships, through Serve's own config path, with only its model
swapped (--model, or --start-preset's fresh weights) and HTTP on 127.0.0.1: what is measured is what users
deploy. --start-preset without --config deploys deployments/gpt2-cluster.yaml on a GPU machine and
deployments/gpt2.yaml on a CPU. The cluster's ingress (--ingress, HAProxy by default, as cluster.yaml
and the KubeRay manifests start Ray) is set in Ray's environment before it starts.

Each level keeps `concurrency` requests in flight until `--requests` have finished
(gpt2_platform.bench.load says how they are built and timed, load_report how they are
shown). Reported per level and mode (--mode stream, nonstream or both): requests/s,
generated tokens/s, time to first
token p50/p99 (streaming: the first chunk; non-streaming: the whole request), latency
p50/p99, time per output token after the first, failures (a 429 counts once its retries, after
its Retry-After, would pass --retry-429-within-s), the 429s retried, and which
processes on the machine used the CPU. With --start-preset the engine is first run alone
on the same model and shapes at batch size = each concurrency, up to the config's engine batch (in a
child process, so its GPU memory is free again before Serve starts), and each level shows HTTP / engine
tokens/s. Against --url it needs only aiohttp and httpx; --config and --start-preset need the package and Ray.
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


REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = {True: REPO / "deployments" / "gpt2-cluster.yaml", False: REPO / "deployments" / "gpt2.yaml"}
"""--start-preset's config without --config: the shipped GPU deployment where there is a GPU."""


def start_app(args: argparse.Namespace) -> dict:
    from gpt2_platform.bench import serve_app
    from gpt2_platform.bench.models import write_model

    port = urllib.parse.urlsplit(args.url).port or 8000
    model_dir = args.model
    if args.start_preset:
        model_dir = Path("runs") / f"bench-serve-{args.start_preset}"
        write_model(model_dir, args.start_preset)
    return serve_app.deploy_config(args.config, model_dir, port, args.ingress)


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
        "--retry-429-within-s",
        type=float,
        default=30.0,
        help="retry a 429 after its Retry-After while within this many seconds of the first try (0: never); "
        "a 429 past it counts as failed",
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
    started = parser.add_argument_group("a local app deployed by this script from a shipped config")
    started.add_argument("--config", type=Path, help="a Serve config file (deployments/*.yaml), deployed as it is")
    started.add_argument("--model", type=Path, help="the model directory to serve in place of the config's")
    started.add_argument(
        "--start-preset", help="serve this preset with fresh weights and the byte tokenizer (e.g. gpt2)"
    )
    started.add_argument(
        "--ingress",
        choices=["haproxy", "proxy", "direct"],
        default="haproxy",
        help="how HTTP reaches the ingress replicas, set in Ray's environment before it starts: HAProxy "
        "balancing every replica (the default, as cluster.yaml and KubeRay start Ray), Serve's Python proxy, "
        "or direct ingress (one replica serves the port)",
    )
    started.add_argument(
        "--engine-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the engine alone at batch size = each concurrency (--no-engine-baseline skips it)",
    )
    args = parser.parse_args()
    if args.model and args.start_preset:
        parser.error("--model and --start-preset both name the model: give one")
    if args.config is None and args.start_preset:
        import torch

        args.config = DEFAULT_CONFIGS[torch.cuda.is_available()]
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file (a Serve config such as deployments/gpt2.yaml)")
    if args.config is not None and not (args.model or args.start_preset):
        parser.error("--config needs the model to serve: --model DIR or --start-preset NAME")
    if (args.model or args.start_preset) and args.config is None:
        parser.error("--model needs --config (the Serve config file to deploy it with)")
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
    modes = list(load.MODES) if args.mode == "both" else [args.mode]
    baseline, app, api_key = None, None, args.api_key
    if args.start_preset and args.engine_baseline:
        from gpt2_platform.bench import serve_app

        engine = serve_app.config_engine(args.config)
        baseline = load.engine_baseline(
            args.start_preset,
            args.concurrency,
            args.prompt_tokens,
            args.max_tokens,
            engine.get("max_batch_size", "auto"),
            engine.get("compile"),
            args.temperature,
        )
        print(f"engine alone: {[(r['batch_size'], round(r['tokens_per_s'])) for r in baseline['rows']]} tokens/s")
    if args.config:
        app = start_app(args)
        api_key = app.pop("api_key") or api_key
        print(
            f"{args.config} deployed ({app['ingress']} ingress) and running in {app['replica_ready_s']:.1f} s "
            f"on {app['num_gpus']:g} GPU(s)",
            flush=True,
        )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    settings = load.LoadSettings(
        url=args.url,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        headers=headers,
        timeout_s=args.timeout_s,
        num_requests=args.requests,
        client_processes=args.client_processes,
        retry_429_within_s=args.retry_429_within_s,
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
