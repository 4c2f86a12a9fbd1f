"""Probe: how long a compiled engine takes to warm every decode shape of every sampling mode.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python tools/probes/compile_warmup.py [--preset tiny]

An empty inductor cache gives the cold start a new replica pays on a fresh node. Runs on CPU or GPU
(on a GPU the graphs are captured too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.engine.engine import Engine, EngineConfig  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = EngineConfig(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, compile=True)
    engine = Engine(GPT2(preset(args.preset)), byte_tokenizer(), config)
    started = time.perf_counter()
    engine.start()
    print(f"{args.preset}: compiled warm-up of every shape and sampling mode in {time.perf_counter() - started:.1f} s")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
