"""Probe: where a batch job's prefill time goes, and the device's time in a job-like run (needs a GPU).

    python tools/probes/prefill_cost.py [--slots 1024] [--max-seq-len 256] [--job-prompts 8192]

A batch job at 1,024 slots admits about engine.max_prefill_tokens prompt tokens at a time, padded to a
power-of-two width and row count. This prints, per (prompts, width), the device time of one prefill
(CUDA events around back-to-back prefills, graphs as the engine replays them) with the cache written by
torch's indexed assignment and by our kernel, and the kernels of one eager prefill. With
`--job-prompts`, it then runs the engine as a batch job does (prompts of 32-128 tokens, 128 new, greedy)
under torch.profiler, with packed prefills and then padded ones, and prints the device's time by kernel
against the wall time; `--trace-out` also writes a timeline of 0.3 s of the packed run.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpt2_platform import traces  # noqa: E402
from gpt2_platform.bench.generation import random_prompts  # noqa: E402
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from gpt2_platform.engine.modes import Pick, SamplingMode  # noqa: E402
from gpt2_platform.engine.prefill import PROMPT_HEADER  # noqa: E402
from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.engine.sampling import SamplingParams  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


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


def prefill_table(model: GPT2, args: argparse.Namespace, device: torch.device) -> None:
    times: dict[str, dict[str, float]] = {}
    for variant, kernel_write in (("indexed assignment", False), ("our kernel", True)):
        # The padded graphs: groups of 16 or more would otherwise run packed (the job-like runs compare both).
        runner = ModelRunner(
            model, args.slots, args.max_seq_len, torch.bfloat16, device, cuda_graphs=True, packed_prefill=False
        )
        runner.cache.prefill_write_kernel = kernel_write
        runner.warmup(("greedy",))
        for shape in args.shapes:
            batch, width = (int(v) for v in shape.split("x"))
            prompts = [p.tolist() for p in random_prompts(batch, width, model.config.vocab_size)]
            slots = list(range(batch))
            ms = device_ms(lambda p=prompts, s=slots, r=runner: r.start_prefill(p, s), args.repeats)
            times.setdefault(shape, {})[variant] = ms
        if kernel_write:
            profile_one(runner, *(int(v) for v in args.shapes[0].split("x")), model.config.vocab_size)
        del runner
        torch.cuda.empty_cache()
    print("| prompts x width | cache by indexed assignment ms | by our kernel ms | padded tokens/s (kernel) |")
    print("|---|---:|---:|---:|")
    for shape, by in times.items():
        batch, width = (int(v) for v in shape.split("x"))
        ours = by["our kernel"]
        print(f"| {shape} | {by['indexed assignment']:.3f} | {ours:.3f} | {batch * width / ours * 1e3:,.0f} |")


def profile_one(runner: ModelRunner, batch: int, width: int, vocab: int) -> None:
    prompts = [p.tolist() for p in random_prompts(batch, width, vocab)]
    rows = runner.prefiller.staged_prompts[:batch]
    runner.start_prefill(prompts, list(range(batch))).tokens()  # stages this shape's rows
    torch.cuda.synchronize()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.prefiller._padded(rows[:, : PROMPT_HEADER + width], width, SamplingMode(Pick.GREEDY, False))
        torch.cuda.synchronize()
    print(f"\nKernels of 5 eager prefills of {batch} x {width} (cache by our kernel):")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


def job_profile(model: GPT2, args: argparse.Namespace, device: torch.device, packed: bool) -> None:
    config = EngineConfig(max_batch_size=args.slots, max_seq_len=args.max_seq_len, dtype="bf16", packed_prefill=packed)
    engine = Engine(model, byte_tokenizer(), config, device=device).start(modes=("greedy",))
    rng = random.Random(0)
    params = GenerationParams(max_tokens=128, ignore_eos=True, sampling=SamplingParams(temperature=0))

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1, 256) for _ in range(rng.randint(32, 128))] for _ in range(args.job_prompts)]

    try:
        engine.generate(prompts(), params)  # captures the shapes met on first use
        batch = prompts()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            done = engine.generate(batch, params)
            wall = time.perf_counter() - started
        if packed and args.trace_out:
            trace_window(engine, prompts(), params, args.trace_out)
    finally:
        engine.shutdown()
    tokens = sum(len(c.token_ids) for c in done)
    events = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(
        f"\nJob-like run, prefills {'packed' if packed else 'padded'}: {args.job_prompts} prompts of 32-128 tokens, "
        f"128 new, {args.slots} slots: {wall:.2f} s, {tokens / wall:,.0f} generated tokens/s; device busy "
        f"{busy_ms / 1e3:.2f} s ({busy_ms / 1e3 / wall:.0%})"
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))


def trace_window(engine: Engine, batch: list[list[int]], params: GenerationParams, path: Path) -> None:
    """A timeline (CPU and CUDA activity, every thread's CUDA API calls) of 0.3 s of the engine in its steady
    state, as a Chrome trace: where the device waits between kernels, and what the engine thread does then."""
    worker = threading.Thread(target=engine.generate, args=(batch, params))
    worker.start()
    time.sleep(1.0)  # past the first wave's prefills, and well before the job's end (a few seconds)
    traces.record_window(path, 0.3)
    worker.join()
    print(f"\ntrace of 0.3 s of the packed job-like run: {path}")
    print_gaps(path)


def print_gaps(path: Path) -> None:
    idle = traces.device_idle(traces.load(path))
    print("\n".join(traces.format_device_idle(idle)) if idle else "no kernels in the trace window")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--shapes", nargs="+", default=["64x128", "32x128", "64x64", "8x128", "1x128"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--job-prompts", type=int, default=0, help="then profile a job-like run of this many")
    parser.add_argument("--trace-out", type=Path, help="with --job-prompts: a Chrome trace of 0.3 s of the packed run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT2(preset(args.preset))
    print(f"{args.preset}, {args.slots} slots of {args.max_seq_len}, bf16, greedy")
    prefill_table(model, args, device)
    if args.job_prompts:
        for packed in (True, False):
            job_profile(model, args, device, packed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
