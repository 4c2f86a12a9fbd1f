"""Probe: what the first prefill at a new batch size costs, SDPA's default choice (cuDNN) against flash.

    python tools/probes/prefill_first_use.py

Prints (batch size, call, ms) for two calls per batch size: the first pays any per-shape
planning, the second is the steady state. Needs a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402


def first_use(runner: ModelRunner, batch_sizes: list[int]) -> list[tuple[int, int, float]]:
    timings = []
    for batch in batch_sizes:
        for call in range(2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            runner.prefill([[1] * 100] * batch, list(range(batch)))
            torch.cuda.synchronize()
            timings.append((batch, call, round(1000 * (time.perf_counter() - started), 1)))
    return timings


def main() -> int:
    torch.manual_seed(0)
    runner = ModelRunner(GPT2(preset("gpt2")), 64, 256, torch.bfloat16, torch.device("cuda"), True)
    runner.prefill([[1] * 100], [0])
    flash = runner.prefiller._attention
    runner.prefiller._attention = contextlib.nullcontext  # SDPA picks its backend itself (cuDNN on an H200)
    print("default SDPA (batch, call, ms):", first_use(runner, [3, 5, 7, 9, 11]), flush=True)
    runner.prefiller._attention = flash  # what the engine does: flash attention for prefills
    print("flash       (batch, call, ms):", first_use(runner, [4, 6, 10, 12, 13]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
