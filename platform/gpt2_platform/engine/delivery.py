"""Each step's output on its way to the consumers: the tokens a launch computed, taken into their sequences,
handed out as sink records or events, and the sequences that end taken out of their slots.

This is the loop's per-token host work, so it stays lean: a quiet sequence's tokens are taken in a step at
a time with numpy, a sink's sequence costs one tuple a token, and the events of one iteration go out in one
call (`Engine.deliver_in_batches`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import repeat

import numpy as np

from gpt2_platform.engine.requests import Deliver, Event, TokenSink, logprob_entries
from gpt2_platform.engine.scheduler import Iteration, Scheduler, Sequence


class Delivery:
    """Takes in the scheduler's launches and hands their tokens to each sequence's consumer."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # With Engine.deliver_in_batches: the events of one loop iteration, handed over together at its end.
        self.deliver: Deliver | None = None
        self._outbox: list[tuple[Callable[[Event], None], Event]] = []
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
        """Hand this iteration's records and events on."""
        if self._sinks:
            sinks, self._sinks = self._sinks, set()
            for sink in sinks:
                sink.send()  # a sink whose consumer is gone cancels its own sequences
        if self._outbox:
            batch, self._outbox = self._outbox, []
            assert self.deliver is not None  # events wait in the outbox only when there is one
            self.deliver(batch)

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
                self.finish(sequence, "length", [], "")
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
            if generated[-1] == sequence.stop_token:
                self.finish(sequence, "stop", generated[:-1], "")
            else:
                self.finish(sequence, "length", generated, "")

    def _append(self, sequence: Sequence, token: int) -> None:
        """Record one generated token; emit it (and its text), or finish the sequence."""
        self.num_generated_tokens += 1
        generated = sequence.generated
        generated.append(token)
        if len(generated) == 1:
            self.first_token_s += time.perf_counter() - sequence.admitted_at
            self.num_first_tokens += 1
        last = token == sequence.stop_token or len(generated) >= sequence.max_tokens
        if last:
            reason = "stop" if token == sequence.stop_token else "length"
        sink = sequence.sink
        if sink is not None:  # the hot path of a served sequence: one tuple per token
            if last:
                self.finish(sequence, reason, [token], "")
            else:  # the record built inline unless log-probabilities ride along: this runs for every token
                key = sequence.sink_key
                record = (
                    (key, token, None, None) if sequence.logprobs is None else self._record(sequence, token, None, None)
                )
                sink.pending.append(record)
                self._sinks.add(sink)
            return
        if sequence.output is None:  # tokens only
            if last:
                self.finish(sequence, reason, [token], "")
            else:
                self._emit(sequence, self._event(sequence, [token], ""))
            return
        emitted = sequence.output.add(token, last)
        if emitted is None:
            return
        tokens, text, ended = emitted
        if ended is None:
            self._emit(sequence, self._event(sequence, tokens, text))
        else:  # a stop string may end it before the scheduler would
            self.finish(sequence, ended, tokens, text)

    def finish(
        self, sequence: Sequence, reason: str, token_ids: list[int], text: str, error: str | None = None
    ) -> None:
        """End a sequence: free its slot and hand out its last output, with how it ended."""
        self.scheduler.free(sequence)
        self.num_finished += 1
        sink = sequence.sink
        if sink is not None:
            if sequence.quiet and sequence.generated:  # a final-only sequence: all its records in one run
                key, generated = sequence.sink_key, sequence.generated
                add_run = getattr(sink, "add_run", None)  # a sink that takes the tokens as one list (generate's)
                if add_run is not None:
                    add_run(key, generated[:-1])
                else:  # a record each, as a link sends them: the tuples made in C
                    sink.pending.extend(zip(repeat(key), generated[:-1], repeat(None), repeat(None)))
                token_ids = generated[-1:]  # with its end-of-text token, as a delta sequence's last record
            sink.add(self._record(sequence, token_ids[0] if token_ids else -1, reason, error))
            self._sinks.add(sink)
            if sequence.on_event is None:
                return
            token_ids = []  # the sink has the tokens; on_event hears only of the end
        event = self._event(sequence, token_ids, text)
        event.finish_reason, event.error = reason, error
        event.prompt_tokens, event.completion_tokens = len(sequence.prompt), len(sequence.generated)
        self._emit(sequence, event)

    def _emit(self, sequence: Sequence, event: Event) -> None:
        on_event = sequence.on_event
        assert on_event is not None  # a sink's sequence with no on_event never emits: finish returns first
        if self.deliver is None:
            on_event(event)
        else:
            self._outbox.append((on_event, event))

    @staticmethod
    def _record(sequence: Sequence, token: int, reason: str | None, error: str | None) -> tuple:
        """A sink's record (TokenRecord): with log-probabilities asked for, the token's and (once) the prompt's."""
        if sequence.logprobs is None:
            return (sequence.sink_key, token, reason, error)
        taken, prompt = sequence.logprobs.take(1 if token >= 0 else 0)
        return (sequence.sink_key, token, reason, error, (taken[0] if taken else None, prompt))

    @staticmethod
    def _event(sequence: Sequence, token_ids: list[int], text: str) -> Event:
        """An event carrying `token_ids` (the next ones the consumer has not had), with their
        log-probabilities when the request asked for them."""
        event = Event(sequence.request_id, token_ids, text, seed=sequence.seed)
        if sequence.logprobs is not None:
            event.logprobs, event.prompt_logprobs = sequence.logprobs.take(len(token_ids))
        return event
