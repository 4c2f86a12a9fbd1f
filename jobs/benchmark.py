"""The optimization report: the training-step ladder and the inference comparison, in one process.

    python jobs/benchmark.py                                  # on a GPU: gpt2, the whole ladder
    python jobs/benchmark.py --profile                        # plus a torch.profiler trace of the best variant
    python jobs/benchmark.py --preset tiny --skip-inference   # CPU smoke run

Writes report.json, report.md and a tokens/s chart into --out (default runs/benchmark-<timestamp>).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench import generation, report  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402

logger = logging.getLogger("benchmark")


def parse_args(argv: list[str] | None, on_gpu: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2" if on_gpu else "tiny")
    parser.add_argument("--batch-size", type=int, default=16 if on_gpu else 4)
    parser.add_argument("--seq-len", type=int, default=1024 if on_gpu else 128)
    parser.add_argument("--steps", type=int, default=20 if on_gpu else 5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5 if on_gpu else 2, help="untimed steps after the first")
    parser.add_argument("--only", nargs="*", help="variant names to run (substring match); the first is the baseline")
    parser.add_argument("--skip-inference", action="store_true", help="skip transformers generate vs our engine")
    parser.add_argument(
        "--profile", nargs="?", const="best", metavar="VARIANT", help="profile one variant (default: the fastest)"
    )
    parser.add_argument("--out", type=Path, help="output folder (default runs/benchmark-<timestamp>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    args = parse_args(argv, on_gpu)
    out_dir = args.out or Path("runs") / f"benchmark-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if not on_gpu:
        logger.warning("no GPU: timings are CPU timings; %s", report.CPU_NOTE)
    ladder = report.select(args.only)
    rows = report.build_rows(ladder, args.preset, args.batch_size, args.seq_len, args.steps, args.warmup, device)
    inference = None
    if not args.skip_inference:
        inference = generation.run(
            args.preset,
            batch_sizes=[1, 8, 32] if on_gpu else [1, 2],
            prompt_tokens=128 if on_gpu else 16,
            new_tokens=128 if on_gpu else 16,
            dtype_name="auto",
            device=device,
        )
    profile = None
    if args.profile:
        if args.profile == "best":
            best = max(rows, key=lambda r: r["tokens_per_s"])["variant"]
            target = next(s for s in ladder if s.name == best)
        else:
            target = report.select([args.profile], ladder)[0]
        profile = report.profile_summary(
            target, args.preset, args.batch_size, args.seq_len, device, out_dir / "profile"
        )
        print(report.format_profile(profile))
    command = shlex.join(["python", "jobs/benchmark.py", *(sys.argv[1:] if argv is None else argv)])
    paths = report.write_report(out_dir, rows, report.environment(device, command), inference, profile)
    print(paths["markdown"].read_text())
    logger.info("report written to %s", out_dir)
    return 0


if __name__ == "__main__":
    configure_logging()
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"error: {error}", flush=True)
        sys.exit(2)
