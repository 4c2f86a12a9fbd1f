"""Probe: the engine loop's host work per generated token, with the model taken out.

    python tools/probes/engine_host_cost.py [--sequences 256] [--tokens 128]

The runner's launch and prefill are replaced by ones that return at once, so what is timed is
the engine's own Python: admitting, launching, taking tokens in, detokenizing, stop checks and
events or token-sink records (the served path: a sequence's tokens go to its ingress's link). The
engine overlaps this work with the GPU's step, so while it stays under the step's GPU time
(docs/benchmarks.md, `jobs/bench_engine.py`) the host does not set the pace. Runs on CPU.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.engine.buffers import Launch  # noqa: E402
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from gpt2_platform.engine.local import LocalEngine
from gpt2_platform.engine.messages import DELTA, FINAL_ONLY, OutputKind, SubmitRequest  # noqa: E402
from gpt2_platform.engine.sampling import SamplingParams  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def instant_runner(engine: Engine) -> None:
    """Printable byte tokens at once, as if the device were infinitely fast."""
    runner = engine.runner

    def start_prefill(prompts: list[list[int]], slots: list[int], echo: bool = False) -> Launch:
        return Launch(torch.full((len(prompts),), 97, dtype=torch.long), len(prompts), None)

    def launch(active: int, continuing: list[int], max_position: int, fed=None) -> Launch:
        out = torch.tensor([97 + (i % 26) for i in range(active)], dtype=torch.long)
        return Launch(out, active, None)

    runner.start_prefill, runner.launch = start_prefill, launch


class Sink:
    """A token sink that pickles each iteration's records, as the token link's Outlet does before sending."""

    def __init__(self) -> None:
        self.pending: list = []
        self.finished = 0

    def add(self, record: tuple, num_generated: int) -> None:
        self.pending.append(record)
        if record[2] is not None:  # the sequence's end (a record per token with deltas)
            self.finished += 1

    def send(self) -> bool:
        records, self.pending = self.pending, []
        pickle.dumps(records)
        return True


def measure(
    sequences: int, tokens: int, incremental: bool, stop: tuple[str, ...], sink: bool, output_kind: OutputKind
) -> float:
    engine = Engine(GPT2(preset("tiny")), byte_tokenizer(), EngineConfig(max_batch_size=sequences, dtype="fp32"))
    instant_runner(engine)
    engine.start(warmup=False)
    params = GenerationParams(max_tokens=tokens, stop=stop, ignore_eos=True, sampling=SamplingParams(temperature=0))
    prompts = [[1, 2, 3]] * sequences
    done = []
    try:
        started = time.perf_counter()
        if sink:
            to = Sink()
            for key, prompt in enumerate(prompts):
                engine.submit(SubmitRequest(key, prompt, params, output_kind), to)
            while to.finished < sequences:
                time.sleep(0.001)
        elif incremental:  # events with text, made by the in-process client
            client = LocalEngine(engine)
            for prompt in prompts:
                client.submit(prompt, params, lambda event: done.append(event) if event.finished else None)
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
        ("every token to a token sink (served over a token link)", True, ()),
        ("one run at the end to a token sink (final only over a token link)", False, ()),
    ):
        sink = name.endswith("link)")
        kind = FINAL_ONLY if name.startswith("one run") else DELTA
        per_token = measure(args.sequences, args.tokens, incremental, stop, sink, kind)
        print(f"| {name} | {per_token:.2f} | {per_token * args.sequences / 1000:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
