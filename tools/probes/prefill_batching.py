"""Probe: what a prefill of a few prompts costs, against one prompt, on the device and on the host.

    python tools/probes/prefill_batching.py [--preset gpt2] [--prompt-tokens 128]

A server admits prompts as requests arrive, a few per engine iteration. Each prefill is launch-bound
at small batches (some 200 kernels whatever the batch), so prompts prefilled together should cost
about what one costs: this prints, per number of prompts admitted together, the device time of one
prefill (CUDA events around many back-to-back prefills), the host time the engine's thread spends
starting one on an idle device, and the device time per prompt. Up to `GRAPHED_PREFILL_MAX` prompts replay a captured
graph of their batch bucket; more take one eager prefill. Packing is off here: these are the padded prefills (groups
of 16 or more run packed in the engine; `prefill_cost.py --job-prompts` compares the two). Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench.generation import random_prompts  # noqa: E402
from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT2(preset(args.preset))
    runner = ModelRunner(
        model, 256, 2 * args.prompt_tokens, torch.bfloat16, device, cuda_graphs=True, packed_prefill=False
    )
    runner.warmup(("greedy",))
    graphed_max = runner.prefiller.graphed_prefill_max
    print(f"{args.preset}, {args.prompt_tokens}-token prompts, bf16, greedy; graphs up to {graphed_max}")
    print("| prompts | path | device ms per prefill | host ms to start it | device ms per prompt |")
    print("|---:|---|---:|---:|---:|")
    for batch in args.batches:
        prompts = [p.tolist() for p in random_prompts(batch, args.prompt_tokens, model.config.vocab_size)]
        slots = list(range(batch))
        runner.prefill(prompts, slots)  # first use of this shape
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeats):
            launch = runner.start_prefill(prompts, slots)
        end.record()
        launch.tokens()
        torch.cuda.synchronize()
        device_ms = start.elapsed_time(end) / args.repeats
        # Back to back, a start waits for the prefill two before it (its staging buffer): time the host's
        # own work on an idle device instead.
        host_s = 0.0
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            runner.start_prefill(prompts, slots)
            host_s += time.perf_counter() - began
        path = "graph" if batch <= graphed_max else "eager"
        print(f"| {batch} | {path} | {device_ms:.3f} | {1e3 * host_s / args.repeats:.3f} | {device_ms / batch:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
