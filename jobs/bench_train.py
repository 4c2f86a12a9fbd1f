"""Benchmark the training step: the fp32 eager baseline against bf16 and torch.compile.

    python jobs/bench_train.py --preset gpt2 --batch-size 16 --seq-len 1024   # on a GPU
    python jobs/bench_train.py --preset tiny --seq-len 128                     # CPU smoke run

Prints a Markdown table (and writes JSON with --json-out); every variant runs
in this one process on the same data, the baseline first.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform as stdlib_platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench.train_step import (  # noqa: E402
    DEFAULT_VARIANTS,
    as_markdown,
    curves_as_markdown,
    loss_curve,
    measure,
    plot_curves,
    release,
    text_batches,
    to_json,
)
from gpt2_platform.jobs_common import configure_logging  # noqa: E402
from gpt2_platform.train.config import OptimConfig  # noqa: E402

logger = logging.getLogger("bench_train")


def selects(pattern: str, name: str) -> bool:
    """--only: a variant's whole name picks it alone; anything else picks every name containing it."""
    names = {v.name for v in DEFAULT_VARIANTS}
    return pattern == name if pattern in names else pattern in name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    parser.add_argument("--only", nargs="*", help="variants to run: whole names, or parts of names")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--curve-steps", type=int, default=0, help="then train each variant this many steps on real text"
    )
    parser.add_argument("--curve-text", type=Path, help="the text file for --curve-steps (bytes as tokens)")
    parser.add_argument("--plot", type=Path, help="with --curve-steps: the curves as a PNG (needs matplotlib)")
    parser.add_argument("--profile-dir", type=Path, help="a profiler trace of 3 steps per variant goes here")
    args = parser.parse_args()
    configure_logging()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else stdlib_platform.processor() or "cpu"
    if device.type != "cuda":
        logger.warning("no GPU: timings are CPU timings, MFU and peak memory are not measured")
    variants = [v for v in DEFAULT_VARIANTS if not args.only or any(selects(o, v.name) for o in args.only)]
    results = []
    for variant in variants:
        logger.info("measuring %s", variant.name)
        try:
            result = measure(
                variant,
                args.preset,
                args.batch_size,
                args.seq_len,
                args.steps,
                args.warmup,
                device,
                profile_dir=args.profile_dir,
            )
        except Exception:  # an optional variant (float8, fused) that this machine cannot run: say so, go on
            logger.exception("%s failed; left out of the table", variant.name)
            release(device)
            continue
        results.append(result)
        logger.info("%s: %.0f tokens/s", variant.name, result.tokens_per_s)
    header = f"{args.preset} on {device_name}, torch {torch.__version__}"
    print(header)
    print(as_markdown(results))
    curves = {}
    if args.curve_steps:
        if args.curve_text is None:
            parser.error("--curve-steps needs --curve-text")
        batches = text_batches(args.curve_text, args.curve_steps, args.batch_size, args.seq_len, device)
        for variant in (v for v in variants if v.batch_size is None):  # the curves share one batch size
            logger.info("loss curve of %s over %d steps", variant.name, args.curve_steps)
            curves[variant.name] = loss_curve(variant, args.preset, batches, device, OptimConfig())
        print(f"\nloss on {args.curve_text.name}, batch {args.batch_size} x {args.seq_len}, seed 0:")
        print(curves_as_markdown(curves))
        title = f"{args.preset}, {args.curve_text.name}, batch {args.batch_size} x {args.seq_len}"
        if args.plot and plot_curves(curves, args.plot, title):
            logger.info("loss curves plotted in %s", args.plot)
    if args.json_out:
        report = {"device": device_name, "torch": torch.__version__, "preset": args.preset, "results": to_json(results)}
        args.json_out.write_text(json.dumps({**report, "curves": curves}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
