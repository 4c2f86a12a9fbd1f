"""Between the engine and one HTTP response: a request's sequences, their events, and when chunks go out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from gpt2_platform.engine.protocol import GenerationEngine
from gpt2_platform.engine.requests import Event, GenerationParams, TokenLogprob
from gpt2_platform.serve.metrics import ServeMetrics


@dataclass(frozen=True)
class Job:
    """One sequence to generate: a prompt and how to continue it."""

    prompt: list[int]
    params: GenerationParams


@dataclass(frozen=True)
class ShownPrompt:
    """A choice's prompt as the response shows it: its text, its token ids, and whether echo puts it
    before the completion (else it only anchors the logprobs' text offsets)."""

    text: str
    tokens: list[int]
    echoed: bool


# First events that mean a request never ran: the engine was full, or it failed.
_REFUSALS = ("refused", "error")


@dataclass
class Update:
    """What one sequence made since the last update: its new text, and its last event if it ended; with
    logprobs, its new tokens with theirs, and (once) the prompt's."""

    index: int
    text: str
    end: Event | None
    logprobs: list[tuple[int, TokenLogprob]] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Choices:
    """The sequences of one request, submitted to the engine together, their output gathered as it comes.

    Events only append to a sequence's pending text; the request's coroutine wakes for the first
    token of each sequence and for each end at once, and otherwise at most once per interval,
    however many tokens came meanwhile. So the work per token here is an append, and the work per
    wake-up (building and sending a chunk) is paid per interval, not per token.
    """

    def __init__(
        self, engine: GenerationEngine, jobs: list[Job], metrics: ServeMetrics, incremental_text: bool = True
    ) -> None:
        """`incremental_text` False: the text comes whole with each sequence's end (a response sent only
        then needs no text before it, and detokenizing token by token costs the ingress host time)."""
        self._loop = asyncio.get_running_loop()
        self.engine, self.metrics = engine, metrics
        self._first: dict[int, Event] = {}  # each sequence's first event, until every one has had it
        self._all_started = asyncio.Event()
        self._texts: dict[int, list[str]] = {}
        self._ends: dict[int, Event] = {}
        self._logprobs: dict[int, list[tuple[int, TokenLogprob]]] = {}  # (token, its log-probabilities)
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        self._urgent = False  # a first token or an end is pending: no waiting for the interval
        self._waiter: asyncio.Future[None] | None = None
        self._waiter_takes_any = False
        self.started_at = time.perf_counter()
        self.first_token_at: dict[int, float] = {}
        self.request_ids: list[int] = []
        self.unfinished = set(range(len(jobs)))
        try:
            for index, job in enumerate(jobs):
                size = len(jobs) if index == 0 else 0  # the engine admits the request whole or not at all
                on_event = self._on_event_of(index)
                self.request_ids.append(
                    engine.submit(job.prompt, job.params, on_event, incremental_text, request_size=size)
                )
        except BaseException:
            self.cancel()
            raise

    def _on_event_of(self, index: int) -> Callable[[Event], None]:
        # Called on this event loop: the engine hands each step's events over in one hop (deliver_in_batches).
        def on_event(event: Event) -> None:
            if not self._all_started.is_set() and index not in self._first:
                self._first[index] = event
                if len(self._first) == len(self.unfinished) or event.finish_reason in _REFUSALS:
                    self._all_started.set()
            if index not in self.unfinished:
                return  # cancelled here already
            urgent = False
            if index not in self.first_token_at:
                now = time.perf_counter()
                if not self.first_token_at:
                    self.metrics.record_first_token(now - self.started_at)
                self.first_token_at[index] = now
                urgent = True
            if event.text:
                self._texts.setdefault(index, []).append(event.text)
            if event.logprobs:
                self._logprobs.setdefault(index, []).extend(zip(event.token_ids, event.logprobs, strict=True))
            if event.prompt_logprobs is not None:
                self._prompt_logprobs[index] = event.prompt_logprobs
            if event.finished:
                self.unfinished.discard(index)
                self._ends[index] = event
                decode_s = time.perf_counter() - self.first_token_at[index]
                self.metrics.record_sequence(event.prompt_tokens, event.completion_tokens, decode_s)
                urgent = True
            elif not event.text:
                return  # nothing to send yet (a token in the middle of a character)
            self._urgent = self._urgent or urgent
            waiter = self._waiter
            if waiter is not None and not waiter.done() and (urgent or self._waiter_takes_any):
                waiter.set_result(None)

        return on_event

    async def started(self) -> Event | None:
        """Wait until every sequence has had its first event; the first refusal or failure, if any."""
        await self._all_started.wait()
        return next((event for event in self._first.values() if event.finish_reason in _REFUSALS), None)

    async def updates(self, interval_s: float) -> AsyncGenerator[list[Update], None]:
        """What the sequences made, in batches: at once for a first token or an end, otherwise at most
        every `interval_s` (0: whenever anything came); until every sequence ended. Closing the
        iterator early cancels the sequences still running."""
        last_at: float | None = None
        try:
            while self._texts or self._ends or self.unfinished:
                if not self._texts and not self._ends:
                    await self._wait(None)
                    continue
                if not self._urgent and last_at is not None:
                    remaining = last_at + interval_s - time.perf_counter()
                    if remaining > 0:
                        await self._wait(remaining)  # an urgent event cuts it short
                        continue
                texts, ends = self._texts, self._ends
                self._texts, self._ends, self._urgent = {}, {}, False
                last_at = time.perf_counter()
                # A sequence's log-probabilities go with its text: those of tokens still without any (the
                # middle of a character) wait for the update that has it.
                pop_logprobs, pop_prompt = self._logprobs.pop, self._prompt_logprobs.pop
                yield [
                    Update(i, "".join(texts.get(i, ())), ends.get(i), pop_logprobs(i, None), pop_prompt(i, None))
                    for i in sorted(texts.keys() | ends.keys())
                ]
        finally:
            self.cancel()

    async def _wait(self, timeout_s: float | None) -> None:
        waiter = self._waiter = self._loop.create_future()
        self._waiter_takes_any = timeout_s is None
        timer = None if timeout_s is None else self._loop.call_later(timeout_s, _settle, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def cancel_one(self, index: int) -> None:
        """Free one sequence's slot early (moderation stopped it); its last event still arrives."""
        self.engine.cancel(self.request_ids[index])

    def cancel(self) -> None:
        """Free the slots of unfinished sequences (a client went away, or one sequence failed)."""
        for index in list(self.unfinished):  # a cancel may deliver the sequence's abort at once
            if index < len(self.request_ids):
                self.engine.cancel(self.request_ids[index])


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
