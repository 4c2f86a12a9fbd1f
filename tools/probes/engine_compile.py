"""Probe: the engine's decode step as captured CUDA graphs, eager against torch.compile (dynamic shapes).

    python tools/probes/engine_compile.py OUT_DIR [eager] [compile]

Prints, per variant: warm-up seconds, decode-step ms at batch 1/8/64/256 (host work included),
the GPU time of one batch-1 step (graph replay alone), generate tokens/s at batch 1/64/256
(128 prompt + 128 new tokens), and a profiler table of batch-1 steps (also written to OUT_DIR).
Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpt2_platform.bench.generation import (  # noqa: E402
    decode_step_latency,
    engine_generate,
    fed_step,
    random_prompts,
)
from gpt2_platform.engine.engine import Engine, EngineConfig  # noqa: E402
from gpt2_platform.engine.modes import Pick, SamplingMode  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def probe(name: str, out: Path) -> dict:
    torch.manual_seed(0)
    model = GPT2(preset("gpt2"))
    config = EngineConfig(max_batch_size=256, max_seq_len=256, dtype="bf16", compile=name == "compile")
    started = time.perf_counter()
    engine = Engine(model, byte_tokenizer(), config).start(modes=("greedy",))  # the probe decodes greedily
    warm_s = time.perf_counter() - started
    latency = {b: decode_step_latency(engine, b, 128) for b in (1, 8, 64, 256)}
    runner = engine.runner
    # Position 128 attends over the 256 span bucket.
    graph, _ = runner.graphs[(1, 256, SamplingMode(Pick.GREEDY, False))]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(500):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - started) * 1000 / 500
    tokens_per_s = {b: engine_generate(engine, random_prompts(b, 128, 50257), 128).tokens_per_s for b in (1, 64, 256)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(20):
            fed_step(runner, [1], [128], [1])
        torch.cuda.synchronize()
    table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    (out / f"profile_{name}.txt").write_text(table)
    print(name, table, sep="\n", flush=True)
    engine.shutdown()
    return {"warm_s": warm_s, "decode_ms": latency, "replay_ms": replay_ms, "generate_tokens_per_s": tokens_per_s}


def main() -> int:
    out = Path(sys.argv[1])
    results = {name: probe(name, out) for name in sys.argv[2:] or ["eager", "compile"]}
    (out / "engine_compile.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
