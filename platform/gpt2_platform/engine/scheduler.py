"""The scheduler's bookkeeping: which sequences wait, which hold a slot, and what a step needs of each slot.

Each loop iteration the engine (engine.py) asks it to admit waiting sequences into free slots (their
prefill) and to launch one decode step for every running sequence; the delivery (delivery.py) takes
the tokens in and frees the slots of the sequences that end. It also keeps what admission needs: how
fast the slots free, and how long a step takes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from gpt2_platform.engine.admission import Admission, DrainRate, Refusal, decide
from gpt2_platform.engine.buffers import Launch
from gpt2_platform.engine.requests import GenerationParams, LogprobStream, TokenSink
from gpt2_platform.engine.runner import ModelRunner

Started = tuple[Launch, np.ndarray, np.ndarray]
"""A launch, the slots it computes for, and the request ids that held them at the launch."""


@dataclass(slots=True)
class Sequence:
    request_id: int
    prompt: list[int]
    params: GenerationParams
    sink: TokenSink  # takes its tokens as records (engine/requests.py, TokenRecord), no text
    sink_key: int
    slot: int = -1
    # Its tokens so far; a quiet sequence's stay in the scheduler's token table until it finishes.
    generated: list[int] = field(default_factory=list)
    # From params, read once per token: the budget, and end-of-text (-1 when it is ignored).
    max_tokens: int = 0
    stop_token: int = -1
    # Quiet: its consumer wants only the end (generate() without stop strings), so its tokens are taken in
    # a whole step at a time with numpy, and no Python runs for it per token.
    quiet: bool = False
    # With params.logprobs: its tokens' (and with echo its prompt's), until events or records carry them.
    logprobs: LogprobStream | None = None
    seed: int = 0  # params.sampling.seed, resolved at submit
    submitted_at: float = 0.0  # time.perf_counter(), for stats()
    admitted_at: float = 0.0


@dataclass(slots=True)
class Iteration:
    """What one loop iteration started on the device: a prefill of new sequences, a decode step, or both."""

    prefill: Started | None
    step: Started | None


class Scheduler:
    """Waiting sequences, the slots, and per slot (as arrays) what a step needs; the engine thread's own,
    but for `add`, `cancel` and the counters, which other threads take `wakeup` for."""

    def __init__(self, runner: ModelRunner, max_batch_size: int, max_seq_len: int, max_prefill_tokens: int) -> None:
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.cancelled: set[int] = set()
        self.slots: list[Sequence | None] = [None] * max_batch_size
        # What a step needs of each slot, as arrays: at hundreds of sequences a step, a Python loop over them
        # to launch the step and another to take its tokens in cost more host time than the device's step
        # (the batch job's py-spy profile, docs/benchmarks.md).
        slots = max_batch_size
        self.occupant: np.ndarray = np.zeros(slots, np.int64)  # the request id in the slot, 0 when free
        self.launched: np.ndarray = np.zeros(
            slots, np.int64
        )  # tokens started on the device (prefill, then a step each)
        self.budget: np.ndarray = np.zeros(slots, np.int64)  # max_tokens
        self.prompt_len: np.ndarray = np.zeros(slots, np.int64)
        self.quiet: np.ndarray = np.zeros(slots, bool)
        self.taken: np.ndarray = np.zeros(slots, np.int64)  # a quiet sequence's tokens taken in
        self.stop_token: np.ndarray = np.full(slots, -1, np.int64)
        self.admitted_at: np.ndarray = np.zeros(slots)
        self.table: np.ndarray = np.zeros((slots, max_seq_len), np.int32)  # a quiet sequence's tokens, by slot
        self.wakeup = threading.Condition()
        self.stopping = False
        # Counters, read by Engine.stats(): how the engine actually batched its work.
        self.num_steps = 0
        self.num_prefills = 0
        self.num_prompt_tokens = 0
        self.batch_sizes: Counter[int] = Counter()
        self.queue_s = 0.0  # submit to admission, summed over sequences
        self.idle_s = 0.0  # the loop waiting with nothing queued or running: work did not come fast enough
        self.drain = DrainRate()  # how fast waiting sequences start: what admission promises a wait from
        self.step_s = 0.0  # a decode step's seconds while busy (moving mean): the modelled drain rate's clock
        self._last_step_at: float | None = None

    # ---- from any thread ---------------------------------------------------------------------
    def add(self, sequence: Sequence) -> None:
        with self.wakeup:
            self.waiting.append(sequence)
            self.wakeup.notify()

    def cancel(self, request_id: int) -> None:
        with self.wakeup:
            self.cancelled.add(request_id)
            self.wakeup.notify()

    def stop(self) -> None:
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()

    def num_running(self) -> int:
        return int(np.count_nonzero(self.occupant))

    def refusal(self, admission: Admission) -> Refusal | None:
        """None if a request may join now under `admission` (engine/admission.py), else why not."""
        return decide(self.num_running(), len(self.waiting), len(self.slots), self.drain_per_s(), admission)

    def drain_per_s(self) -> float:
        """Sequences a second the slots should start, for admission: the rate measured over the last window,
        or, where more, the one modelled from the step time and the lengths the slots hold (every slot
        frees once its sequence has run its max_tokens). The measured rate counts demand as much as slots:
        after a quiet spell (or at start) it is low whatever the slots could do, and would refuse a burst
        the engine drains in a moment; the model ignores sequences that stop early, so it errs low too,
        and the higher of the two is the better estimate."""
        measured = self.drain.per_s()
        occupied = self.occupant != 0
        if self.step_s <= 0 or not occupied.any():
            return measured
        mean_tokens = float(self.budget[occupied].mean())
        return max(measured, len(self.slots) / (max(mean_tokens, 1.0) * self.step_s))

    # ---- on the engine thread ----------------------------------------------------------------
    def wait_for_work(self, in_flight: bool) -> set[int] | None:
        """Wait until a sequence waits or runs (or the engine stops: None); the ids cancelled meanwhile.
        `in_flight`: the last iteration started work whose tokens are not taken in yet."""
        with self.wakeup:
            if not self.stopping and not self.waiting and not in_flight and not self.occupant.any():
                idle_from = time.perf_counter()
                while not self.stopping and not self.waiting and not self.occupant.any():
                    self.wakeup.wait()
                self.idle_s += time.perf_counter() - idle_from
                self._last_step_at = None  # an idle gap is no step
            if self.stopping:
                return None
            cancelled, self.cancelled = self.cancelled, set()
        return cancelled

    def drop_cancelled(self, cancelled: set[int]) -> list[Sequence]:
        """Take the `cancelled` sequences out of the queue; returns them and those in slots, to end."""
        if not cancelled:
            return []
        with self.wakeup:
            dropped = [s for s in self.waiting if s.request_id in cancelled]
            self.waiting = deque(s for s in self.waiting if s.request_id not in cancelled)
        return dropped + [s for s in self.slots if s is not None and s.request_id in cancelled]

    def take_all(self) -> list[Sequence]:
        """Every sequence held or waiting, the queue emptied: the loop failed."""
        with self.wakeup:
            pending = [s for s in self.slots if s is not None] + list(self.waiting)
            self.waiting.clear()
        return pending

    def free(self, sequence: Sequence) -> None:
        """Its slot is free for the next admission (nothing if it never held one)."""
        if 0 <= sequence.slot < len(self.slots) and self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None
            self.occupant[sequence.slot] = 0

    def admit(self) -> Started | None:
        """Start the prefill of waiting requests in free slots (lowest first, keeping decode batches small).

        Their first tokens stay on the device, where this iteration's decode step goes on from them;
        the host takes them in with that step's tokens, in the next iteration.
        """
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        with self.wakeup:
            if not self.waiting:
                return None
            free = iter(np.flatnonzero(self.occupant == 0).tolist())
            slot = next(free, None)
            while self.waiting and slot is not None and (not admitted or len(self.waiting[0].prompt) <= budget):
                sequence = self.waiting.popleft()
                sequence.slot = slot
                budget -= len(sequence.prompt)
                self.slots[slot] = sequence
                admitted.append(sequence)
                slot = next(free, None)
        if not admitted:
            return None
        self.drain.record(len(admitted))
        now = time.perf_counter()
        for sequence in admitted:
            self._occupy(sequence, now)
        slots = np.array([s.slot for s in admitted], np.int64)
        # One prompt asking for its log-probabilities makes the whole group's prefill the eager one that
        # computes them (the others' are not kept): echo requests are rare, and one prefill a step is simpler.
        echo = any(s.params.echo and s.logprobs is not None for s in admitted)
        prefill = self.runner.start_prefill([s.prompt for s in admitted], slots.tolist(), echo=echo)
        self.num_prefills += 1
        self.num_prompt_tokens += sum(len(s.prompt) for s in admitted)
        return prefill, slots, self.occupant[slots]

    def _occupy(self, sequence: Sequence, now: float) -> None:
        """Write an admitted sequence's sampling and bookkeeping into its slot."""
        s, slot = sequence.params.sampling, sequence.slot
        self.runner.set_sampling(
            slot, s.temperature, s.top_k, s.top_p, sequence.seed, logprobs=sequence.logprobs is not None
        )
        self.occupant[slot] = sequence.request_id
        self.launched[slot] = 1
        self.budget[slot] = sequence.max_tokens
        self.prompt_len[slot] = len(sequence.prompt)
        self.quiet[slot] = sequence.quiet
        self.taken[slot] = 0
        self.stop_token[slot] = sequence.stop_token
        self.admitted_at[slot] = now
        self.queue_s += now - sequence.submitted_at
        sequence.admitted_at = now

    def launch(self) -> Started | None:
        """Start a decode step for every running sequence that may still need a token."""
        slots = np.flatnonzero((self.occupant != 0) & (self.launched < self.budget))
        if not slots.size:
            return None
        # The token a sequence feeds this step sits at position len(prompt) - 1 + launched.
        max_position = int((self.prompt_len[slots] + self.launched[slots]).max()) - 1
        active = int(slots[-1]) + 1
        self.launched[slots] += 1
        self.num_steps += 1
        self.batch_sizes[slots.size] += 1
        return self.runner.launch(active, slots, max_position), slots, self.occupant[slots]

    def time_step(self) -> None:
        """A decode step was launched: time the loop's iteration, for `step_s`."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            elapsed = now - self._last_step_at
            self.step_s = elapsed if self.step_s == 0 else 0.9 * self.step_s + 0.1 * elapsed
        self._last_step_at = now
