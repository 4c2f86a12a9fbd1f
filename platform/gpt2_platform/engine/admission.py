"""Whether an engine takes one more sequence, decided from how fast its slots free.

A fixed bound on waiting sequences (what the engine had before) is wrong both ways: at a few hundred
slots that each free every few milliseconds, a queue of 64 empties in a fraction of a second, so clients
past it get 429 and sleep while the engine idles; and for long generations the same 64 may wait for
minutes. What a client cares about is how long it waits to start. So the engine measures the rate at which
waiting sequences start (its drain rate) and takes a newcomer when the queue ahead of it should drain
within the wait budget (`limits.max_queue_wait_s`); a refused one is told to retry when enough of the queue
should have drained, not after a fixed second. A rate measured over a window in which the queue was
empty for a while counts the demand, not what the slots can do (an engine that just started, or a burst
after a quiet spell), so the engine also models the rate from its step time and the lengths its slots
hold, and admission takes the higher (Scheduler.drain_per_s). A hard bound (`limits.max_waiting`) still caps the queue's
memory. A sequence cancelled while it waits (its client went away) leaves the queue at once (Engine.cancel).

This module imports no torch: the ingress builds the policy, the engine process applies it.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass

RATE_WINDOW_S = 2.0
"""How far back the drain rate looks: long enough to smooth one step's burst of admissions (a whole batch
of finished sequences replaced at once), short enough to follow a change of load."""
MAX_RETRY_AFTER_S = 30
"""The longest Retry-After given: past it, a client's estimate is worth no more than trying again."""


@dataclass(frozen=True)
class Admission:
    """What the ingress asks of an engine for one new sequence (sent with it on every transport)."""

    max_waiting: int
    """Hard bound on sequences waiting for a slot (memory), whatever the drain rate."""
    max_wait_s: float
    """The wait budget: take the sequence only if the queue ahead of it should drain within this."""
    size: int = 1
    """The sequences of the request this is the first of: all are taken, or none (the rest are sent
    without an Admission, never refused)."""


class DrainRate:
    """Sequences admitted into slots per second, over the last RATE_WINDOW_S; thread-safe."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._in_window = 0
        self._lock = threading.Lock()

    def record(self, admitted: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, admitted))
            self._in_window += admitted
            self._trim(now)

    def per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return self._in_window / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._in_window -= self._events.popleft()[1]


_RETRY = re.compile(r" \[retry after (\d+) s\]")


@dataclass(frozen=True)
class Refusal:
    retry_after_s: int
    message: str

    def text(self) -> str:
        """The refusal as the one string an engine's refusal carries on every transport."""
        return f"{self.message} [retry after {self.retry_after_s} s]"

    @classmethod
    def parse(cls, text: str) -> Refusal | None:
        """The inverse of `text`, also where a transport wrapped it in words of its own; None for a text that
        carries no retry time."""
        match = _RETRY.search(text)
        return cls(int(match.group(1)), text[: match.start()] + text[match.end() :]) if match else None


def decide(running: int, waiting: int, max_batch_size: int, drain_per_s: float, admission: Admission) -> Refusal | None:
    """None to take `admission.size` more sequences into an engine with `running` of `max_batch_size` slots busy and
    `waiting` queued; else why not and when to retry.

    What fits the free slots is taken (a request larger than the queue still runs on an idle engine).
    Otherwise `ahead` of the new sequences' last there are that many admissions beyond the free slots,
    which at the drain rate take ahead / rate seconds; the hard bound counts the same sequences."""
    size = admission.size
    ahead = waiting + size - max(max_batch_size - running, 0)
    if ahead <= 0 or running + waiting == 0:
        return None
    state = f"{running} sequences running, {waiting} waiting"
    if ahead > admission.max_waiting:
        retry = _retry_after(ahead - admission.max_waiting, drain_per_s, admission.max_wait_s)
        return Refusal(retry, f"{state}, the most this engine queues ({admission.max_waiting})")
    if drain_per_s > 0 and ahead / drain_per_s <= admission.max_wait_s:
        return None
    if drain_per_s <= 0:
        # Nothing has started for a whole window: every slot holds a long sequence. The budget cannot be
        # promised; a short queue (one batch) still waits its turn rather than being refused outright.
        if ahead <= max_batch_size:
            return None
        return Refusal(_retry_after(ahead, 0.0, admission.max_wait_s), f"{state}; no slot freed lately")
    wait_s = ahead / drain_per_s
    retry = _retry_after(ahead - drain_per_s * admission.max_wait_s, drain_per_s, admission.max_wait_s)
    return Refusal(
        retry,
        f"{state}; at the {drain_per_s:.0f} sequences/s this engine starts, a new one would wait {wait_s:.1f} s, "
        f"more than the {admission.max_wait_s:g} s budget",
    )


def _retry_after(excess: float, drain_per_s: float, max_wait_s: float) -> int:
    """Seconds until `excess` more sequences should have started (whole seconds, as Retry-After takes)."""
    if drain_per_s <= 0:
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(max_wait_s)))
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(max(excess, 1) / drain_per_s)))
