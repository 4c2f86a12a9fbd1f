"""`Engine.generate()`'s consumer: a block of requests run to their ends, their token records gathered into
`Completion`s, with text.

The engine core makes no text (engine/engine.py): a request without stop strings goes final-only (quiet in
the engine, its records in one run at its end) and is decoded here at once; one with stop strings goes as
deltas, and the same `TextOutput` a server runs (engine/output.py) cuts it, cancelling it at a stop string.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING

from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.output import TextOutput
from gpt2_platform.engine.requests import Completion, GenerationParams, TokenLogprob, TokenRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _Stopped:
    """A stop-string request's text so far, as its TextOutput emits it."""

    __slots__ = ("output", "token_ids", "text", "finish_reason")

    def __init__(self, output: TextOutput) -> None:
        self.output = output
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # set by a stop string before the engine ends it


class CompletionSink:
    """A token sink (engine/requests.py, TokenSink) for one block of requests, keyed by their index.

    `pending`, `add` and `send` run on the engine's thread: `send` hands the iteration's records over and,
    only for requests with stop strings, runs their text (the cost the engine paid itself before it made no
    text). Everything else waits for `completions` on the caller's thread."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        byte_table: ByteTable | None,
        eos_token_id: int | None,
        params: list[GenerationParams],
        cancel: Callable[[int], None],
    ) -> None:
        self.pending: list[TokenRecord] = []
        self.params = params
        self.eos_token_id = eos_token_id
        # The byte table decodes as the tokenizer does (checked when built), without the tokenizer's
        # per-call conversions that held the GIL the engine's thread needs every step (docs/benchmarks.md).
        self.decode = tokenizer.decode if byte_table is None else byte_table.decode
        self.stopped = {
            key: _Stopped(TextOutput(tokenizer, byte_table, p, eos_token_id)) for key, p in enumerate(params) if p.stop
        }
        self._engine_ids: list[int] = []  # by key: what `cancel` takes
        self._to_cancel: set[int] = set()  # keys stopped before their engine id came back from submit
        self._cancel = cancel
        self._ids_lock = threading.Lock()
        self._received: list[TokenRecord] = []
        self._runs: dict[int, list[int]] = {}  # key -> a final-only sequence's tokens before its last record
        self._num_ended = 0
        self._done = threading.Event()

    def started(self, engine_id: int) -> None:
        """The next key's engine id, as submit returned it (on the caller's thread)."""
        with self._ids_lock:
            key = len(self._engine_ids)
            self._engine_ids.append(engine_id)
            stopped = key in self._to_cancel
        if stopped:
            self._cancel(engine_id)

    def add_run(self, key: int, tokens: list[int]) -> None:
        """A final-only sequence's tokens but its last, at its end, as one list (no record a token); its
        last record (`add`) follows."""
        self._runs[key] = tokens

    def add(self, record: TokenRecord, num_generated: int) -> None:
        self.pending.append(record)
        self._num_ended += 1

    def send(self) -> bool:
        records, self.pending = self.pending, []
        if self.stopped:
            for record in records:
                stopped = self.stopped.get(record[0])
                if stopped is not None:
                    self._text(record, stopped)
        self._received += records
        if self._num_ended == len(self.params):
            self._done.set()
        return True

    def _text(self, record: TokenRecord, stopped: _Stopped) -> None:
        key, token, reason = record[0], record[1], record[2]
        if stopped.finish_reason is not None or token < 0:
            return  # past its stop string (the cancel's end still comes), or an end with no token
        emitted = stopped.output.add(token, reason is not None)
        if emitted is None:
            return
        token_ids, text, ended = emitted
        stopped.token_ids += token_ids
        stopped.text += text
        if ended is not None and reason is None:  # a stop string: the engine would go on
            stopped.finish_reason = ended
            with self._ids_lock:
                engine_id = self._engine_ids[key] if key < len(self._engine_ids) else None
                if engine_id is None:
                    self._to_cancel.add(key)
            if engine_id is not None:
                self._cancel(engine_id)

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
        end = records[-1]
        reason, error = end[2] or "error", end[3]
        tokens = self._runs.pop(key, [])
        tokens += map(itemgetter(1), records)
        if tokens[-1] < 0:  # only a sequence's end row may carry no token
            tokens.pop()
        completion_tokens = len(tokens)
        stopped = self.stopped.get(key)
        if stopped is not None:
            token_ids, text = stopped.token_ids, stopped.text
            if stopped.finish_reason is not None:
                reason, error, completion_tokens = stopped.finish_reason, None, len(stopped.output.generated)
        else:
            token_ids = tokens[:-1] if reason == "stop" and tokens and tokens[-1] == self.eos_token_id else tokens
            text = self.decode(token_ids) if error is None else ""
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
