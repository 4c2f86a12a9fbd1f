"""Probe: how long the training loop waits for its next micro-batch at an epoch boundary, read inline against
read ahead by a thread (train/loop.py `micro_batches`), in one run.

    python tools/probes/epoch_boundary.py [--blocks 1024] [--step-ms 30] [--epochs 3]

A materialized dataset of token blocks, split for one worker as Ray Train splits it; the "step" is a sleep of
--step-ms (a GPU's step for GPT-2 124M at 16 x 1,024 tokens is tens of ms). Runs on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from gpt2_platform.train.loop import PREFETCH_MICRO_BATCHES, micro_batches  # noqa: E402


def waits(dataset, micro: int, step_s: float, epochs: int, prefetch: int) -> tuple[list[float], list[float]]:
    """(the waits for the first micro-batch of each epoch after the first, every other wait), in seconds."""
    per_epoch = dataset.count() // micro
    shard = dataset.streaming_split(1)[0]
    batches = micro_batches(shard, micro, torch.device("cpu"), 0, 0, per_epoch, prefetch=prefetch)
    waited = []
    for _ in range(per_epoch * epochs):
        started = time.perf_counter()
        next(batches)
        waited.append(time.perf_counter() - started)
        time.sleep(step_s)
    batches.close()
    boundary = [waited[e * per_epoch] for e in range(1, epochs)]
    inner = [w for i, w in enumerate(waited) if i % per_epoch and i > 2]  # the first few: the run's own start
    return boundary, inner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1024, help="token blocks in the dataset")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 50257, (args.blocks, args.block_size + 1), dtype=np.int32)
        dataset = ray.data.from_items([{"tokens": row} for row in tokens]).materialize()
        print(f"{args.blocks} blocks of {args.block_size} tokens, micro-batches of {args.micro_batch}, "
              f"a {args.step_ms:g} ms step, {args.epochs} epochs")  # fmt: skip
        print("| read | wait at each epoch boundary, ms | other waits, median / max ms |\n|---|---|---|")
        for label, prefetch in (
            ("inline (prefetch 0)", 0),
            (f"ahead ({PREFETCH_MICRO_BATCHES})", PREFETCH_MICRO_BATCHES),
        ):
            boundary, inner = waits(dataset, args.micro_batch, args.step_ms / 1000, args.epochs, prefetch)
            shown = ", ".join(f"{1000 * w:.1f}" for w in boundary)
            print(
                f"| {label} | {shown} | {1000 * statistics.median(inner):.2f} / {1000 * max(inner):.1f} |", flush=True
            )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
