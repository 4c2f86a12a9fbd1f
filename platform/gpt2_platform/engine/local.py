"""An `Engine` in this process behind the client interface (engine/protocol.py), as the engine process's and
the ingress's clients put theirs: the core takes typed requests and gives token records, and this client
turns them into events with text (engine/output.py, TextStream) outside the core.

The records come on the engine's thread, once per step, and the events go out from there: through the
`deliver_in_batches` function in one call where one was given, else each to its own callback.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpt2_platform.engine.messages import DELTA, SubmitRequest
from gpt2_platform.engine.output import TextOutput, TextStream
from gpt2_platform.engine.requests import Deliver, Event, GenerationParams, TokenRecord, hand_over

if TYPE_CHECKING:
    from gpt2_platform.engine.engine import Engine


class LocalEngine:
    """The client of an `Engine` in this process, and the token sink (engine/requests.py, TokenSink) of every
    sequence it submits."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.pending: list[TokenRecord] = []
        self._deliver: Deliver | None = None
        self._ids = itertools.count(1)
        # key -> its stream until it ends; key -> the engine's id, for cancels, once Engine.submit returned it
        self._streams: dict[int, TextStream] = {}
        self._engine_ids: dict[int, int] = {}
        self._stopped_early: set[int] = set()  # ended by a stop string before Engine.submit returned
        self._lock = threading.Lock()

    def check_health(self) -> None:
        self.engine.check_health()

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        self.engine.validate(prompt_ids, params)

    def deliver_in_batches(self, deliver: Deliver) -> None:
        """Hand each engine step's events to `deliver` in one call, as (on_event, event) pairs, on the engine's
        thread: a server whose requests live on one event loop then hops there once per step. Set it before
        submitting."""
        self._deliver = deliver

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        request_size: int = 1,
    ) -> int:
        """Queue one sequence; `on_event` gets its events on the engine's thread (or through `deliver`).

        `incremental_text` False (and no stop strings): the text comes whole with the last event.
        `request_size` is the interface's: this engine never refuses, so it ignores it."""
        params = dataclasses.replace(params, sampling=params.sampling.resolved())  # events report the seed
        assert params.sampling.seed is not None
        engine = self.engine
        output = TextOutput(engine.tokenizer, engine.byte_table, params, engine.eos_token_id, incremental_text)
        key = next(self._ids)
        stream = TextStream(on_event, output, len(prompt_ids), params.sampling.seed, params.logprobs is not None)
        with self._lock:
            self._streams[key] = stream  # before Engine.submit: its first records may come at once
        try:
            # Stop strings are this client's: the core ends a sequence by token only.
            engine_id = engine.submit(SubmitRequest(key, list(prompt_ids), params, DELTA), self)
        except BaseException:
            with self._lock:
                del self._streams[key]
            raise
        with self._lock:
            if key in self._streams:
                self._engine_ids[key] = engine_id
            stopped = key in self._stopped_early
            self._stopped_early.discard(key)
        if stopped:
            engine.cancel(engine_id)
        return key

    def cancel(self, request_id: int) -> None:
        """Stop a sequence; its "abort" event comes once the engine has freed its slot (within a step)."""
        with self._lock:
            engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self.engine.cancel(engine_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- the token sink, on the engine's thread -------------------------------------------------
    def add(self, record: TokenRecord, num_generated: int) -> None:
        self.pending.append(record)

    def send(self) -> bool:
        """The one loop over a step's records here: each into its sequence's events, handed over together."""
        records, self.pending = self.pending, []
        batch: list[tuple[Callable[[Event], None], Event]] = []
        streams = self._streams
        for record in records:
            key, token, reason, error = record[0], record[1], record[2], record[3]
            stream = streams.get(key)
            if stream is None:
                continue  # ended here already by a stop string: the engine's tail is dropped
            event = stream.take(key, token, reason, error, record[4] if len(record) > 4 else None)
            if event is None:
                continue
            if event.finished:
                self._ended(key, cancel=reason is None)
            batch.append((stream.on_event, event))
        hand_over(batch, self._deliver)
        return True

    def _ended(self, key: int, cancel: bool) -> None:
        """Forget a sequence; `cancel`: a stop string ended it here, and the engine would go on."""
        with self._lock:
            del self._streams[key]
            engine_id = self._engine_ids.pop(key, None)
            if cancel and engine_id is None:
                self._stopped_early.add(key)
        if cancel and engine_id is not None:
            self.engine.cancel(engine_id)
