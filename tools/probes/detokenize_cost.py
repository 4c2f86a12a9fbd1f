"""Probe: host time per streamed token of incremental detokenization, through the tokenizer vs the byte table.

    python tools/probes/detokenize_cost.py

Streams the demo stories' tokens (byte tokenizer) in 128-token sequences, as the engine does for each
running sequence at every step, and prints microseconds per token for both paths.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

from gpt2_platform import demo_data  # noqa: E402
from gpt2_platform.engine.detokenize import ByteTable, IncrementalDetokenizer  # noqa: E402
from gpt2_platform.tokenizer import byte_tokenizer  # noqa: E402


def main() -> int:
    tokenizer = byte_tokenizer()
    tokenizer.model_max_length = int(1e12)
    ids = tokenizer(" ".join(demo_data.stories(100)))["input_ids"][:5000]
    for name, table in (("through the tokenizer", None), ("byte table", ByteTable.of(tokenizer))):
        started = time.perf_counter()
        for start in range(0, len(ids), 128):
            detokenizer = IncrementalDetokenizer(tokenizer, table)
            for token_id in ids[start : start + 128]:
                detokenizer.add(token_id)
        print(f"{name:>22}: {(time.perf_counter() - started) / len(ids) * 1e6:5.1f} us per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
