"""Summarise a training run's profiler traces: the top operators and GPU kernels, and how to open them.

    python jobs/trace_summary.py runs/<run>/profile [--top 15]

The traces are written by `train.profile=true` (`train.profile_steps=[first, last]`). Open one in
Perfetto (https://ui.perfetto.dev, "Open trace file") or chrome://tracing for the timeline;
TensorBoard's profiler plugin is deprecated and not installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from gpt2_platform import traces  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="a run's profile directory, e.g. runs/demo-tiny/profile")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args()
    try:
        print(traces.summary(args.directory, args.top))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
