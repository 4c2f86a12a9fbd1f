"""Which training setups fit gpt2-xl (or any preset) on a 24, 16 or 12 GB card, and what each costs in speed.

    python jobs/bench_memory.py --presets gpt2 gpt2-xl --caps 24 16 12     # on one GPU

Every (preset, setup) trains a few steps in a child process held to a memory cap with
`torch.cuda.set_per_process_memory_fraction`, trying the smallest cap first; the table gives the caps it
fits, its peak memory and its tokens/s (bf16, eager, one worker, the same batch for every row).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.bench import memory  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402

logger = logging.getLogger("bench_memory")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-xl"])
    parser.add_argument("--setups", nargs="+", default=list(memory.SETUPS), choices=list(memory.SETUPS))
    parser.add_argument("--caps", nargs="+", type=float, default=[24, 16, 12], help="memory caps in GB (GiB)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one untimed")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("PRESET", "SETUP"), help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    if args.one:  # the child: one run, its result as a JSON line
        run = memory.run_one(*args.one, args.cap_gib, args.batch_size, args.seq_len, args.steps)
        print(json.dumps(memory.to_json([run])[0]))
        return 0
    configure_logging()

    def log(run: memory.Run) -> None:
        outcome = (
            f"{run.peak_reserved_gib:.1f} GiB reserved, {run.tokens_per_s:,.0f} tokens/s" if run.fits else run.error
        )
        logger.info("%s, %s, cap %s GB: %s", run.preset, run.setup, run.cap_gib, outcome)

    runs = []
    for preset_name in args.presets:
        for setup in args.setups:
            runs += memory.smallest_cap(Path(__file__).resolve(), preset_name, setup, args.caps, shape, log)
    print(f"batch {args.batch_size} x {args.seq_len}, bf16, eager, one worker")
    print(memory.as_markdown(runs, args.caps))
    if args.json_out:
        memory.write(args.json_out, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
