"""gc_pauses: the collector's pauses counted per generation, and start-up objects frozen out of its walk."""

from __future__ import annotations

import gc

from gpt2_platform import gc_pauses


def test_pauses_are_counted_per_generation_and_the_counter_detaches():
    pauses = gc_pauses.GcPauses()
    try:
        gc.collect(2)
        gc.collect(0)
        stats = pauses.stats()
        assert stats["gc_count"][2] >= 1 and stats["gc_count"][0] >= 1
        assert stats["gc_s"][2] > 0 and 0 < stats["gc_longest_s"][2] <= stats["gc_s"][2]
    finally:
        pauses.close()
    counted = pauses.stats()["gc_count"]
    gc.collect(2)
    assert pauses.stats()["gc_count"] == counted


def test_settle_freezes_what_the_process_holds():
    try:
        kept = [object() for _ in range(1000)]
        gc_pauses.settle()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
