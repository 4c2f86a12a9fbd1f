"""Between the engine and one HTTP response: a request's sequences, their events, and when chunks go out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gpt2_platform.engine.engine import Engine, Event, GenerationParams
from gpt2_platform.engine.process import EngineProcess
from gpt2_platform.serve.metrics import ServeMetrics


@dataclass(frozen=True)
class Job:
    """One sequence to generate: a prompt and how to continue it."""

    prompt: list[int]
    params: GenerationParams


class Choices:
    """The sequences of one request, submitted to the engine together, their events merged as they come.

    Submitting here, synchronously, right after the admission check (rather than
    when a stream is first iterated) keeps the check and the engine's queue in
    step: no other request can slip in between on this event loop.
    """

    def __init__(self, engine: Engine | EngineProcess, jobs: list[Job], metrics: ServeMetrics) -> None:
        loop = asyncio.get_running_loop()
        self.engine, self.metrics = engine, metrics
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.started_at = time.perf_counter()
        self.first_token_at: dict[int, float] = {}
        self.request_ids: list[int] = []
        self.unfinished = set(range(len(jobs)))
        try:
            for index, job in enumerate(jobs):
                on_event = self._deliver_to(loop, index)
                self.request_ids.append(engine.submit(job.prompt, job.params, on_event))
        except BaseException:
            self.cancel()
            raise

    def _deliver_to(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable[[Event], None]:
        # Called on this event loop: the engine hands each step's events over in one hop (deliver_in_batches).
        return lambda event: self.queue.put_nowait((index, event))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every sequence finished; closing early cancels the rest."""
        try:
            while self.unfinished:
                index, event = await self.queue.get()
                self._record(index, event)
                yield index, event
        finally:
            self.cancel()

    def cancel_one(self, index: int) -> None:
        """Free one sequence's slot early (moderation stopped it); its last event still arrives."""
        self.engine.cancel(self.request_ids[index])

    def cancel(self) -> None:
        """Free the slots of unfinished sequences (a client went away, or one sequence failed)."""
        for index in self.unfinished:
            if index < len(self.request_ids):
                self.engine.cancel(self.request_ids[index])

    def _record(self, index: int, event: Event) -> None:
        now = time.perf_counter()
        if not self.first_token_at:
            self.metrics.record_first_token(now - self.started_at)
        first = self.first_token_at.setdefault(index, now)
        if event.finished:
            self.unfinished.discard(index)
            self.metrics.record_sequence(event.prompt_tokens, event.completion_tokens, now - first)


class ChunkPacer:
    """When a stream's pending chunks go out: as soon as nothing else waits, at most every `interval_s`.

    The first chunk (time to first token) and the last one are never held back.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.last_sent: float | None = None

    def ready(self, more_waiting: bool, finished: bool) -> bool:
        if more_waiting and not finished:
            return False
        now = self.clock()
        if finished or self.last_sent is None or now - self.last_sent >= self.interval_s:
            self.last_sent = now
            return True
        return False


def run_callbacks(batch: list[tuple[Callable[[Event], None], Event]]) -> None:
    for on_event, event in batch:
        on_event(event)
