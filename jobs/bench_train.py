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

from gpt2_platform.bench.train_step import DEFAULT_VARIANTS, as_markdown, measure, to_json  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402

logger = logging.getLogger("bench_train")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    parser.add_argument("--only", nargs="*", help="variant names to run (substring match)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    configure_logging()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else stdlib_platform.processor() or "cpu"
    if device.type != "cuda":
        logger.warning("no GPU: timings are CPU timings, MFU and peak memory are not measured")
    variants = [v for v in DEFAULT_VARIANTS if not args.only or any(o in v.name for o in args.only)]
    results = []
    for variant in variants:
        logger.info("measuring %s", variant.name)
        results.append(measure(variant, args.preset, args.batch_size, args.seq_len, args.steps, args.warmup, device))
        logger.info("%s: %.0f tokens/s", variant.name, results[-1].tokens_per_s)
    header = f"{args.preset} on {device_name}, torch {torch.__version__}"
    print(header)
    print(as_markdown(results))
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {"device": device_name, "torch": torch.__version__, "preset": args.preset, "results": to_json(results)},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
