"""Probe: why a CUDA graph capture costs far more than the kernels it records (needs a GPU).

    python tools/probes/capture_cost.py [--slots 1024] [--no-compile] [--top 25]

A batch job's engine logs the graphs it captures on first use, and they take far longer than the prefills
they record (docs/benchmarks/2026-12-03-s16-batch-h200.md); a Serve replica's decode warm-up is slow per graph too,
with warm caches. This builds the engine's runner as a batch job does
(GPT-2 124M, bf16, our decode kernels, the token pick compiled unless --no-compile), then profiles the
greedy warm-up's decode captures and times each packed prefill group's first use, profiling the first:
the top functions by cumulative time say where the capture's seconds go (dynamo, inductor, the allocator,
Triton's loader, synchronisation).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402

# (prompts, tokens) of groups a batch job admits: about max_prefill_tokens of 32-128-token prompts each.
GROUPS = [(100, 8000), (60, 4000), (120, 7000), (30, 2000), (100, 8100)]


def profiled(label: str, fn, top: int) -> float:
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    fn()
    profile.disable()
    elapsed = time.perf_counter() - started
    print(f"\n{label}: {elapsed:.3f} s; its top functions by cumulative time:")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(top)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    runner = ModelRunner(
        GPT2(preset("gpt2")),
        args.slots,
        256,
        torch.bfloat16,
        torch.device("cuda"),
        cuda_graphs=True,
        compile_step=args.compile,
        vocab_limit=257,
        decode_kernels="triton",
    )
    profiled(
        f"greedy decode warm-up ({len(runner.batch_buckets)} captures)",
        lambda: runner.warmup(("greedy",), prefills=False),
        args.top,
    )
    rng = random.Random(0)
    for i, (count, tokens) in enumerate(GROUPS):
        prompts = [[rng.randrange(1, 256) for _ in range(tokens // count)] for _ in range(count)]
        before = runner.captures_on_use
        run = lambda p=prompts: runner.start_prefill(p, list(range(len(p)))).tokens()  # noqa: E731
        if i == 0:
            seconds = profiled(f"first packed prefill of {count} prompts, {tokens} tokens", run, args.top)
        else:
            started = time.perf_counter()
            run()
            seconds = time.perf_counter() - started
        captured = runner.captures_on_use - before
        print(f"packed prefill, {count} prompts, {tokens} tokens: {seconds:.3f} s, {captured} captured", flush=True)
        started = time.perf_counter()
        run()
        print(f"  the same again (replayed): {time.perf_counter() - started:.4f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
