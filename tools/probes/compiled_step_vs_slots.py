"""Probe: does the compiled decode step's time grow with the number of cache slots? (CPU or GPU)

    python tools/probes/compiled_step_vs_slots.py [--device cuda]

A step that writes one token per sequence should not care how many slots the cache has. If
torch.compile turns the cache writes into a copy of the whole cache, the compiled step's time
grows with the slots; this prints eager and compiled step times at 4 and 256 slots.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench.generation import fed_step  # noqa: E402
from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    for slots in (4, 256):
        for compiled in (False, True):
            model = GPT2(preset(args.preset))
            runner = ModelRunner(model, slots, 256, torch.float32, device, cuda_graphs=False, compile_step=compiled)
            started = time.perf_counter()
            fed_step(runner, [1], [100], [1])  # compiles on first use
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            for _ in range(50):
                fed_step(runner, [1], [100], [1])
            step_ms = (time.perf_counter() - started) / 50 * 1000
            print(f"slots {slots:4d} compiled {compiled!s:5}: first call {first_s:5.1f} s, step {step_ms:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
