"""The garbage collector's pauses in a serving process, and keeping what lives forever out of its way.

A request's objects can outlive a few young collections and reach the oldest generation, and each
full collection walks everything the process holds: torch, transformers, Ray and FastAPI, about 330K
objects and some 200 ms on a 2-core machine (tools/probes/gc_pause.py). Every stream that process
serves waits meanwhile. How often full collections came under load was not measured. `settle()` after start-up moves what the
process holds by then into the permanent generation, which no collection walks; `GcPauses` counts
the pauses per generation, so a benchmark can show what is left of them.
"""

from __future__ import annotations

import gc
import threading
import time


def settle() -> None:
    """Collect once, then freeze what is left: it lives as long as the process does."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Counts and times the collector's pauses, per generation, from when it is built."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started_at = 0.0
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        paused = time.perf_counter() - self._started_at
        generation = info["generation"]
        with self._lock:
            self.count[generation] += 1
            self.total_s[generation] += paused
            self.longest_s[generation] = max(self.longest_s[generation], paused)

    def stats(self) -> dict[str, list]:
        """Per generation 0, 1, 2: collections, their total seconds, the longest one's seconds."""
        with self._lock:
            return {"gc_count": list(self.count), "gc_s": list(self.total_s), "gc_longest_s": list(self.longest_s)}

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
