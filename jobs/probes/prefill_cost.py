"""Probe: where a batch job's prefill time goes, at the engine's shapes (needs a GPU).

    python jobs/probes/prefill_cost.py [--slots 1024] [--max-seq-len 256]

A batch job at 1,024 slots admits about engine.max_prefill_tokens prompt tokens at a time, padded to a
power-of-two width and row count. This prints, per (prompts, width), the device time of one prefill
(CUDA events around back-to-back prefills), its padded tokens/s, and the same forward without the
cache (the model's own `hidden`): the difference is what writing the cache costs. Then the kernels of one
eager prefill at the job's usual shape (torch.profiler, sorted by device time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpt2_platform.bench.generation import random_prompts  # noqa: E402
from gpt2_platform.engine.runner import PROMPT_HEADER, ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402


def device_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--shapes", nargs="+", default=["64x128", "32x128", "64x64", "16x128", "8x128", "1x128"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT2(preset(args.preset))
    runner = ModelRunner(model, args.slots, args.max_seq_len, torch.bfloat16, device, cuda_graphs=True)
    runner.warmup(("greedy",))
    bare = runner.model
    print(f"{args.preset}, {args.slots} slots of {args.max_seq_len}, bf16, greedy")
    print("| prompts x width | path | device ms | padded tokens/s | forward without cache ms | cache's share |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        batch, width = (int(v) for v in shape.split("x"))
        prompts = [p.tolist() for p in random_prompts(batch, width, model.config.vocab_size)]
        slots = list(range(batch))
        ms = device_ms(lambda p=prompts, s=slots: runner.start_prefill(p, s), args.repeats)
        tokens = torch.tensor(prompts, device=device)
        last = torch.full((batch,), width - 1, device=device)
        with torch.inference_mode(), runner._prefill_attention():
            plain = device_ms(lambda t=tokens, at=last: runner._logits(bare.hidden(t, hidden_at=at)), args.repeats)
        path = "graph" if runner._graphed_prefill(batch, width) else "eager"
        print(f"| {shape} | {path} | {ms:.3f} | {batch * width / ms * 1e3:,.0f} | {plain:.3f} | {1 - plain / ms:.0%} |")
    batch, width = (int(v) for v in args.shapes[0].split("x"))
    prompts = [p.tolist() for p in random_prompts(batch, width, model.config.vocab_size)]
    rows = runner.staged_prompts[:batch]
    runner.start_prefill(prompts, list(range(batch))).tokens()  # stages this shape's rows
    torch.cuda.synchronize()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner._prefill(rows[:, : PROMPT_HEADER + width], width, "greedy")
        torch.cuda.synchronize()
    print(f"\nKernels of 5 eager prefills of {batch} x {width}:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
