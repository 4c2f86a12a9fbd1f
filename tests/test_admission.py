"""Admission by drain rate (engine/admission.py): a queue is taken while it should start within the wait
budget, and a refusal's Retry-After is when enough of it should have drained."""

from __future__ import annotations

import dataclasses

import pytest

from gpt2_platform.engine.admission import MAX_RETRY_AFTER_S, Admission, DrainRate, Refusal, decide

BUDGET = Admission(max_waiting=4096, max_wait_s=2.0)


def test_free_slots_and_no_queue_take_anything():
    assert decide(running=3, waiting=0, max_batch_size=8, drain_per_s=0.0, admission=BUDGET) is None
    # A request larger than the whole bound still runs on an idle engine.
    tight = Admission(max_waiting=1, max_wait_s=0.1)
    assert decide(0, 0, 8, 0.0, dataclasses.replace(tight, size=50)) is None


def test_a_queue_that_drains_within_the_budget_is_joined():
    # 256 slots full and 600 waiting: at 2,000 starts a second the newcomer starts in 0.3 s.
    assert decide(running=256, waiting=600, max_batch_size=256, drain_per_s=2000.0, admission=BUDGET) is None


def test_past_the_budget_the_refusal_says_when_to_retry():
    refusal = decide(running=256, waiting=999, max_batch_size=256, drain_per_s=100.0, admission=BUDGET)
    assert refusal is not None
    # 1,000 ahead at 100 a second is 10 s; 2 s of it fit the budget: retry when the other 800 have gone.
    assert refusal.retry_after_s == 8
    assert "100 sequences/s" in refusal.message and "2 s budget" in refusal.message


def test_the_hard_bound_caps_the_queue_whatever_the_rate():
    bound = Admission(max_waiting=10, max_wait_s=60.0)
    assert decide(256, 9, 256, 1e6, bound) is None
    refusal = decide(256, 10, 256, 1e6, bound)
    assert refusal is not None and "most this engine queues (10)" in refusal.message
    assert refusal.retry_after_s == 1


def test_no_slot_freed_lately_queues_one_batch_then_refuses():
    assert decide(8, 7, 8, 0.0, BUDGET) is None
    refusal = decide(8, 8, 8, 0.0, BUDGET)
    assert refusal is not None and refusal.retry_after_s == 2


def test_what_fits_the_free_slots_is_taken_whatever_is_still_being_placed():
    # 4 slots, 1 running, 2 submitted and not yet placed: one more still fits, even with no queue allowed.
    no_queue = Admission(max_waiting=0, max_wait_s=5.0)
    assert decide(1, 2, 4, 0.0, no_queue) is None
    assert decide(1, 3, 4, 0.0, no_queue) is not None


def test_retry_after_is_capped():
    refusal = decide(256, 4000, 256, 1.0, BUDGET)
    assert refusal is not None and refusal.retry_after_s == MAX_RETRY_AFTER_S


def test_drain_rate_counts_only_its_window():
    rate = DrainRate(window_s=2.0)
    rate.record(100, now=10.0)
    rate.record(300, now=11.0)
    assert rate.per_s(now=11.5) == pytest.approx(200.0)
    assert rate.per_s(now=12.5) == pytest.approx(150.0)  # the first 100 left the window
    assert rate.per_s(now=20.0) == 0.0


def test_a_refusal_travels_as_text_and_reads_back():
    refusal = Refusal(7, "256 sequences running, 900 waiting")
    assert refusal.text() == "256 sequences running, 900 waiting [retry after 7 s]"
    assert Refusal.parse(refusal.text()) == refusal
    assert Refusal.parse(f"the engine is busy ({refusal.text()})") == Refusal(
        7, f"the engine is busy ({refusal.message})"
    )
    assert Refusal.parse("the engine failed") is None
