"""Probe: where one batch-1 request's time goes in the engine (prefill, decode steps, the rest).

    python tools/probes/batch1_timeline.py [--preset gpt2] [--prompt-tokens 128] [--new-tokens 128]

bench_engine.py's batch-1 figure is a whole `engine.generate` of one prompt: its prefill, then
new_tokens - 1 decode steps, plus the hand-offs to and from the engine's thread. This times the
parts on their own, same engine, same prompt: the prefill alone (synchronised), the pipelined decode
step, and the whole request, and prints what is left over. With `--trace DIR` it also writes a
torch profiler trace of one request (CPU and CUDA) for chrome://tracing or Perfetto.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench.generation import pipelined_step_latency, random_prompts  # noqa: E402
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from gpt2_platform.engine.sampling import SamplingParams  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """The median of `repeats` synchronised calls, in ms."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--trace", type=Path, help="write a profiler trace of one request here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT2(preset(args.preset))
    config = EngineConfig(
        max_batch_size=256, max_seq_len=args.prompt_tokens + args.new_tokens, compile=device.type == "cuda"
    )
    engine = Engine(model, byte_tokenizer(), config, device=device).start(modes=("greedy",))
    prompt = random_prompts(1, args.prompt_tokens, model.config.vocab_size)[0].tolist()
    greedy = SamplingParams(temperature=0.0)
    params = GenerationParams(max_tokens=args.new_tokens, ignore_eos=True, sampling=greedy)
    runner = engine.runner
    try:
        request_ms = timed_ms(lambda: engine.generate([prompt], params), device, args.repeats)
        with engine.scheduler.wakeup:  # the loop is idle between requests; the runner is ours for a moment
            runner.set_sampling(0, 0.0, 0, 1.0, 0)
            prefill_ms = timed_ms(lambda: runner.prefill([prompt], [0]), device, args.repeats)
            repeats = min(100, config.max_seq_len - args.prompt_tokens - 12)
            step_ms = pipelined_step_latency(engine, 1, args.prompt_tokens, repeats)
        decode_ms = (args.new_tokens - 1) * step_ms
        print(f"{args.preset}, batch 1, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, {device}")
        print("| part | ms |\n|---|---:|")
        print(f"| whole request (engine.generate), median of {args.repeats} | {request_ms:.2f} |")
        print(f"| prefill alone | {prefill_ms:.2f} |")
        print(f"| {args.new_tokens - 1} decode steps at the pipelined {step_ms:.3f} ms | {decode_ms:.2f} |")
        print(f"| the rest (hand-offs, first step, detokenizing) | {request_ms - prefill_ms - decode_ms:.2f} |")
        print(f"tokens/s: {1000 * args.new_tokens / request_ms:,.0f}")
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as profiler:
                engine.generate([prompt], params)
            args.trace.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(args.trace / "batch1_request.json"))
            print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
