"""Probe: what one full garbage collection costs a process that imports what a serving replica imports.

    python tools/probes/gc_pause.py

A replica's requests promote their objects to the oldest generation, so full collections come often
under load, and each walks every object the process holds (torch, transformers, Ray, FastAPI and
this package). This counts those objects and times full collections, before and after
`gc_pauses.settle()` (collect, then freeze what is left), as the replicas do after start-up.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

from gpt2_platform import gc_pauses  # noqa: E402
from gpt2_platform.serve import app  # noqa: E402, F401  (imports what an ingress replica imports)


def full_collection_ms(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - started))
    return min(times)


def main() -> int:
    print(f"objects tracked: {len(gc.get_objects()):,}")
    print(f"full collection: {full_collection_ms():.1f} ms")
    gc_pauses.settle()
    print(f"full collection after settle(): {full_collection_ms():.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
