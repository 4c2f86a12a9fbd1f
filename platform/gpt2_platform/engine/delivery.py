"""Each step's output on its way to the consumers: the tokens a launch computed, taken into their sequences,
handed out as records to each sequence's sink, and the sequences that end taken out of their slots.

This is the loop's per-token host work, so it stays lean: a quiet sequence's tokens are taken in a step at
a time with numpy, any other costs one tuple a token, and each sink sends once per iteration.
"""

from __future__ import annotations

import time
from itertools import repeat

import numpy as np

from gpt2_platform.engine.requests import TokenSink, logprob_entries
from gpt2_platform.engine.scheduler import Iteration, Scheduler, Sequence


class Delivery:
    """Takes in the scheduler's launches and hands their tokens to each sequence's consumer."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._sinks: set[TokenSink] = set()  # the sinks that took records this iteration
        # Counters, read by Engine.stats().
        self.num_generated_tokens = 0
        self.num_finished = 0
        # From admission to a sequence's first token handed out, summed over the sequences that had one.
        self.first_token_s = 0.0
        self.num_first_tokens = 0

    def collect(self, iteration: Iteration | None) -> None:
        """Take in the first tokens of the last prefill and the tokens of the last decode step; sequences
        that ended meanwhile drop theirs."""
        if iteration is None:
            return
        # The prefill ran before the step on the device: its tokens (in admission order) come first.
        if iteration.prefill is not None:
            launch, slots, occupants = iteration.prefill
            self._take(slots, occupants, launch.array(), launch.logprobs(), launch.prompt_logprobs)
        if iteration.step is not None:
            launch, slots, occupants = iteration.step
            logprobs = launch.logprobs()  # like the tokens, by slot
            if logprobs is not None:
                logprobs = (logprobs[0][slots], logprobs[1][slots])
            self._take(slots, occupants, launch.array()[slots], logprobs)

    def flush(self) -> None:
        """Hand this iteration's records on."""
        if self._sinks:
            sinks, self._sinks = self._sinks, set()
            for sink in sinks:
                sink.send()  # a sink whose consumer is gone cancels its own sequences

    def _take(
        self,
        slots: np.ndarray,
        occupants: np.ndarray,
        tokens: np.ndarray,
        logprobs: tuple[np.ndarray, np.ndarray] | None = None,
        prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Take in one token for each of `slots`, launched while `occupants` held them; a slot whose
        sequence ended (or was cancelled) since then drops its token. `logprobs`: the rows' values and
        top ids (Launch.logprobs), when the launch computed them; `prompt_logprobs`: an echo prefill's."""
        scheduler = self.scheduler
        kept = scheduler.occupant[slots] == occupants
        if not kept.all():
            slots, tokens = slots[kept], tokens[kept]
            if logprobs is not None:
                logprobs = (logprobs[0][kept], logprobs[1][kept])
            if prompt_logprobs is not None:
                prompt_logprobs = (prompt_logprobs[0][kept], prompt_logprobs[1][kept])
        quiet = scheduler.quiet[slots]
        if quiet.any():
            self._take_quiet(slots[quiet], tokens[quiet])
        if quiet.all():
            return
        held = scheduler.slots
        loud = np.flatnonzero(~quiet)
        for row, slot, token in zip(loud.tolist(), slots[loud].tolist(), tokens[loud].tolist(), strict=True):
            sequence = held[slot]
            stream, top = sequence.logprobs, sequence.params.logprobs
            if prompt_logprobs is not None and stream is not None and sequence.params.echo:
                count = len(sequence.prompt) - 1
                scored = logprob_entries(prompt_logprobs[0][row, :count], prompt_logprobs[1][row, :count], top)
                stream.prompt = [None, *scored]
            if sequence.max_tokens == 0:  # scoring only: the prefill's token is not wanted
                self.finish(sequence, "length")
                continue
            if stream is not None:
                assert logprobs is not None  # a sequence asking for them makes its launches compute them
                stream.tokens += logprob_entries(logprobs[0][row : row + 1], logprobs[1][row : row + 1], top)
            self._append(sequence, token)

    def _take_quiet(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Quiet sequences' tokens, a step's at once: into the token table, and the finished ones out."""
        scheduler = self.scheduler
        taken = scheduler.taken[slots]
        scheduler.table[slots, taken] = tokens
        taken += 1
        scheduler.taken[slots] = taken
        self.num_generated_tokens += slots.size
        first = taken == 1
        if first.any():
            self.first_token_s += float((time.perf_counter() - scheduler.admitted_at[slots[first]]).sum())
            self.num_first_tokens += int(first.sum())
        ended = (taken >= scheduler.budget[slots]) | (tokens == scheduler.stop_token[slots])
        for slot in slots[ended].tolist():
            sequence = scheduler.slots[slot]
            generated = scheduler.table[slot, : scheduler.taken[slot]].tolist()
            sequence.generated = generated
            self.finish(sequence, "stop" if generated[-1] == sequence.stop_token else "length", generated[-1])

    def _append(self, sequence: Sequence, token: int) -> None:
        """Record one generated token: a record to the sequence's sink, or its end."""
        self.num_generated_tokens += 1
        generated = sequence.generated
        generated.append(token)
        if len(generated) == 1:
            self.first_token_s += time.perf_counter() - sequence.admitted_at
            self.num_first_tokens += 1
        if token == sequence.stop_token:
            self.finish(sequence, "stop", token)
        elif len(generated) >= sequence.max_tokens:
            self.finish(sequence, "length", token)
        else:  # the hot path: one tuple per token, built inline unless log-probabilities ride along
            sink = sequence.sink
            sink.pending.append(
                (sequence.sink_key, token, None, None)
                if sequence.logprobs is None
                else self._record(sequence, token, None, None)
            )
            self._sinks.add(sink)

    def finish(self, sequence: Sequence, reason: str, token: int = -1, error: str | None = None) -> None:
        """End a sequence: free its slot and hand its sink the last record (`token`, or -1 for none), with how
        it ended; a quiet sequence's tokens go before it in one run."""
        self.scheduler.free(sequence)
        self.num_finished += 1
        sink = sequence.sink
        if sequence.quiet and sequence.generated:
            key, generated = sequence.sink_key, sequence.generated
            add_run = getattr(sink, "add_run", None)  # a sink that takes the tokens as one list (generate's)
            if add_run is not None:
                add_run(key, generated[:-1])
            else:  # a record each, as a link sends them: the tuples made in C
                sink.pending.extend(zip(repeat(key), generated[:-1], repeat(None), repeat(None)))
        sink.add(self._record(sequence, token, reason, error), len(sequence.generated))
        self._sinks.add(sink)

    @staticmethod
    def _record(sequence: Sequence, token: int, reason: str | None, error: str | None) -> tuple:
        """A sink's record (TokenRecord): with log-probabilities asked for, the token's and (once) the prompt's."""
        if sequence.logprobs is None:
            return (sequence.sink_key, token, reason, error)
        taken, prompt = sequence.logprobs.take(1 if token >= 0 else 0)
        return (sequence.sink_key, token, reason, error, (taken[0] if taken else None, prompt))
