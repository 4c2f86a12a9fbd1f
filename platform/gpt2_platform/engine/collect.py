"""`Engine.generate()`'s consumer: a block of requests run to their ends, their token records gathered into
`Completion`s, with text.

The engine core makes no text (engine/engine.py): a request without stop strings goes final-only (quiet in
the engine, its records in one run at its end) and is decoded here at once; one with stop strings goes as
deltas through the same `TextStream` a client runs (engine/output.py), which cuts it at a stop string.
"""

from __future__ import annotations

import threading
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING

from gpt2_platform.engine.messages import StepOutput, StepSink
from gpt2_platform.engine.output import TextOutput, TextStream
from gpt2_platform.engine.requests import Completion, Event, GenerationParams, TokenLogprob, TokenRecord

if TYPE_CHECKING:
    from gpt2_platform.engine.engine import Engine


class CompletionSink(StepSink):
    """The token sink of one block of requests, keyed by their index.

    `pending`, `add` and `send` run on the engine's thread: `send` keeps the iteration's records and, only
    for requests with stop strings, makes their text. Everything else waits for `completions` on the caller's
    thread."""

    def __init__(self, engine: Engine, params: list[GenerationParams]) -> None:
        super().__init__(engine)
        self.params = params
        self.eos_token_id = engine.eos_token_id
        # The byte table decodes as the tokenizer does (checked when built), without the tokenizer's
        # per-call conversions that held the GIL the engine's thread needs every step (docs/benchmarks.md).
        byte_table = engine.byte_table
        self.decode = engine.tokenizer.decode if byte_table is None else byte_table.decode
        self._events: dict[int, list[Event]] = {key: [] for key, p in enumerate(params) if p.stop}
        self.stopped = {  # a stop-string request's text, made as its tokens come
            key: TextStream(events.append, TextOutput(engine.tokenizer, byte_table, params[key], engine.eos_token_id),
                            0, 0, False)
            for key, events in self._events.items()
        }  # fmt: skip
        self._received: list[TokenRecord] = []
        self._runs: dict[int, list[int]] = {}  # key -> a final-only sequence's tokens before its last record
        self._num_ended = 0
        self._done = threading.Event()

    def add_run(self, key: int, tokens: list[int]) -> None:
        """A final-only sequence's tokens but its last, at its end, as one list (no record a token); its
        last record (`add`) follows."""
        self._runs[key] = tokens

    def ended(self, key: int, record: TokenRecord, num_generated: int) -> None:
        self._num_ended += 1

    def send(self) -> bool:
        records, self.pending = self.pending, []
        self._finished.clear()
        if self.stopped:
            for record in records:
                events = self._events.get(record[0])
                if events is not None and not (events and events[-1].finished):  # past a stop string: dropped
                    self._text(record)
        self._received += records
        if self._num_ended == len(self.params):
            self._done.set()
        return True

    def _text(self, record: TokenRecord) -> None:
        key, reason = record[0], record[2]
        stream = self.stopped[key]
        event = stream.take(key, record[1], reason, record[3], None)
        if event is not None:
            stream.on_event(event)
            if event.finished and reason is None:  # a stop string: the engine would go on
                self.cancel(key)

    def send_output(self, output: StepOutput) -> bool:
        raise AssertionError("a block's records are kept, not sent")

    def wait(self, timeout_s: float) -> bool:
        """Whether every request has ended."""
        return self._done.wait(timeout_s)

    def completions(self, prompts: list[list[int]]) -> list[Completion]:
        """Every request's completion, in order (after `wait`)."""
        # Grouped by C loops, not a Python step a token: a block's tokens are many, and this runs while
        # the engine's thread may need the GIL for the next block. A stable sort keeps each key's order.
        by_key = groupby(sorted(self._received, key=itemgetter(0)), key=itemgetter(0))
        return [self._completion(key, len(prompts[key]), list(records)) for key, records in by_key]

    def _completion(self, key: int, prompt_tokens: int, records: list[TokenRecord]) -> Completion:
        params = self.params[key]
        events = self._events.get(key)
        if events is not None:  # its text and how it ended as its stream made them
            end = events[-1]
            token_ids = [token for event in events for token in event.token_ids]
            text, reason, error = "".join(event.text for event in events), end.finish_reason, end.error
            completion_tokens = end.completion_tokens
        else:
            reason, error = records[-1][2] or "error", records[-1][3]
            token_ids = self._runs.pop(key, [])
            token_ids += map(itemgetter(1), records)
            if token_ids[-1] < 0:  # only a sequence's end row may carry no token
                token_ids.pop()
            completion_tokens = len(token_ids)
            if reason == "stop" and token_ids and token_ids[-1] == self.eos_token_id:
                token_ids.pop()
            text = self.decode(token_ids) if error is None else ""
        assert reason is not None
        logprobs: list[TokenLogprob] | None = None
        prompt_logprobs = None
        if params.logprobs is not None:
            scored = [record[4] for record in records if len(record) > 4]
            logprobs = [lp for lp, _ in scored if lp is not None][: len(token_ids)]
            prompt_logprobs = next((prompt for _, prompt in scored if prompt is not None), None)
        seed = params.sampling.seed
        assert seed is not None  # generate() resolves it before submitting
        return Completion(
            token_ids=token_ids, text=text, finish_reason=reason, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, seed=seed, error=error, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
