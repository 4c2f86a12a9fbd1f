"""Probe: the engine loop's host work per generated token, with the model taken out.

    python jobs/probes/engine_host_cost.py [--sequences 256] [--tokens 128]

The runner's launch and prefill are replaced by ones that return at once, so what is timed is
the engine's own Python: admitting, launching, taking tokens in, detokenizing, stop checks and
events. The engine overlaps this work with the GPU's step, so while it stays under the step's GPU
time (about 1.4 ms at batch 256 compiled, on an H200) the host does not set the pace. Runs on CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from gpt2_platform.engine.runner import Launch  # noqa: E402
from gpt2_platform.engine.sampling import SamplingParams  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def instant_runner(engine: Engine) -> None:
    """Printable byte tokens at once, as if the device were infinitely fast."""
    runner = engine.runner

    def prefill(prompts: list[list[int]], slots: list[int]) -> list[int]:
        return [97] * len(prompts)

    def launch(rows: list, max_position: int) -> Launch:
        out = torch.tensor([97 + (i % 26) for i in range(len(rows))], dtype=torch.long)
        return Launch(out, len(rows), None)

    runner.prefill, runner.launch = prefill, launch


def measure(sequences: int, tokens: int, incremental: bool, stop: tuple[str, ...]) -> float:
    engine = Engine(GPT2(preset("tiny")), byte_tokenizer(), EngineConfig(max_batch_size=sequences, dtype="fp32"))
    instant_runner(engine)
    engine.start(warmup=False)
    params = GenerationParams(max_tokens=tokens, stop=stop, ignore_eos=True, sampling=SamplingParams(temperature=0))
    prompts = [[1, 2, 3]] * sequences
    done = []
    try:
        started = time.perf_counter()
        if incremental:
            for prompt in prompts:
                engine.submit(prompt, params, lambda event: done.append(event) if event.finished else None)
            while len(done) < sequences:
                time.sleep(0.001)
        else:
            engine.generate(prompts, params)
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    return seconds / (sequences * tokens) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    print("| events | us per token | ms per step at this batch |\n|---|---|---|")
    for name, incremental, stop in (
        ("one at the end (generate, batch jobs)", False, ()),
        ("every token, streamed (serving)", True, ()),
        ("every token, with two stop strings", True, ("\n\n", "END")),
    ):
        per_token = measure(args.sequences, args.tokens, incremental, stop)
        print(f"| {name} | {per_token:.2f} | {per_token * args.sequences / 1000:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
