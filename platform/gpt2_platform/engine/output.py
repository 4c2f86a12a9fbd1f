"""Output processing: a sequence's tokens turned into the text and events a client sees.

The engine ends a sequence only by token: end-of-text, its budget, a cancel. Everything about text is here:
incremental detokenizing, stop strings, and holding back a tail that could still grow into one. The split
is vLLM's: the per-token text work runs in the processes that serve HTTP, spread over the machine's cores,
not in the one that feeds the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpt2_platform.engine.detokenize import ByteTable, IncrementalDetokenizer, find_stop
from gpt2_platform.engine.messages import DELTA, OutputKind, RowLogprobs, StepOutput
from gpt2_platform.engine.requests import Deliver, Event, GenerationParams, LogprobStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextOutput:
    """One sequence's text as its tokens arrive.

    With `incremental` False (and no stop strings) only the first token is announced (no ids, no text: a
    server still learns when it came; not even that without `announce`), then nothing until the end, when
    the whole text is decoded at once: detokenizing every token of a large batch costs more host time than
    the device step, and a caller that wants only the result need not pay it.
    """

    __slots__ = ("detokenizer", "tokenizer", "stop", "hold", "incremental", "announce_at", "generated",
                 "emitted_chars", "eos_id")  # fmt: skip

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        byte_table: ByteTable | None,
        params: GenerationParams,
        eos_token_id: int | None,
        incremental: bool = True,
        announce: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, byte_table)
        self.stop = tuple(params.stop)
        self.hold = max((len(stop) - 1 for stop in self.stop), default=0)
        self.incremental = incremental or bool(self.stop)
        self.announce_at = 1 if announce else 0  # the token count whose token is announced (0: none)
        self.eos_id = None if params.ignore_eos else eos_token_id
        self.generated: list[int] = []
        self.emitted_chars = 0

    def add(self, token: int, last: bool) -> tuple[list[int], str, str | None] | None:
        """Take one generated token; `last`: the scheduler ends the sequence with it (end-of-text or
        token budget). Returns (token ids, text, finish reason) to emit, or None for nothing now."""
        self.generated.append(token)
        is_eos = token == self.eos_id
        if not self.incremental:
            if not last:
                return ([], "", None) if len(self.generated) == self.announce_at else None
            tokens = self.generated[:-1] if is_eos else self.generated
            return tokens, self._final_text(), "stop" if is_eos else "length"
        if is_eos:
            return [], self._final_text(), "stop"
        detokenizer = self.detokenizer
        before = len(detokenizer.text)
        detokenizer.add(token)
        if self.stop:
            cut = find_stop(detokenizer.text, self.stop, before)
            if cut is not None:
                return [token], self._text_until(cut), "stop"
        if last:
            return [token], self._final_text(), "length"
        # Hold back a tail that could still become a stop string.
        return [token], self._text_until(max(self.emitted_chars, len(detokenizer.text) - self.hold)), None

    def _final_text(self) -> str:
        """The text not yet emitted, decoded whole (this also flushes an unfinished character)."""
        ids = self.generated
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        pending = text[self.emitted_chars :]
        self.emitted_chars = len(text)
        return pending

    def _text_until(self, end: int) -> str:
        text = self.detokenizer.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return text


class TextStream:
    """One sequence as a client sees it: the rows a core sends for it (a token, how it ended, its
    log-probabilities) turned into the Events its consumer gets. Every client runs this, so text, stop
    strings and log-probabilities are made the same way whichever transport brought the tokens."""

    __slots__ = ("on_event", "output", "prompt_tokens", "seed", "logprobs")

    def __init__(
        self,
        on_event: Callable[[Event], None],
        output: TextOutput,
        prompt_tokens: int,
        seed: int,
        logprobs: bool,
    ) -> None:
        self.on_event, self.output = on_event, output
        self.prompt_tokens, self.seed = prompt_tokens, seed
        self.logprobs = LogprobStream() if logprobs else None

    def take(
        self, key: int, token: int, reason: str | None, error: str | None, row_logprobs: RowLogprobs | None
    ) -> Event | None:
        """One row of the sequence's output (token -1: it ended with none); the event to hand over, or None
        for nothing yet. The event is finished where the core ended the sequence or a stop string did
        (then `reason` is None, and the caller must cancel it in the core)."""
        if row_logprobs is not None:
            token_logprob, prompt_logprobs = row_logprobs
            assert self.logprobs is not None  # only a sequence that asked gets them
            if token_logprob is not None:
                self.logprobs.tokens.append(token_logprob)
            if prompt_logprobs is not None:
                self.logprobs.prompt = prompt_logprobs
        if token < 0:  # aborted, failed, refused, or a prompt only scored
            return self.final(key, [], "", reason or "error", error)
        emitted = self.output.add(token, reason is not None)
        if emitted is None:
            return None
        tokens, text, finish = emitted
        if finish is None:
            return self.event(key, tokens, text)
        return self.final(key, tokens, text, finish)

    def event(self, key: int, tokens: list[int], text: str) -> Event:
        """An event with `tokens`, the next the consumer has not had, and their log-probabilities."""
        event = Event(key, tokens, text, seed=self.seed)
        if self.logprobs is not None:
            event.logprobs, event.prompt_logprobs = self.logprobs.take(len(tokens))
        return event

    def final(self, key: int, tokens: list[int], text: str, reason: str, error: str | None = None) -> Event:
        """The sequence's last event."""
        event = self.event(key, tokens, text)
        event.finish_reason, event.error = reason, error
        event.prompt_tokens, event.completion_tokens = self.prompt_tokens, len(self.output.generated)
        return event


_GOING_ON = (None, None, None)  # a row's end where its sequence goes on
_NONE_FINISHED: dict = {}


class OutputProcessor:
    """A client's sequences on their way to their consumers, as vLLM's output processor: the one loop over a
    core's StepOutputs, for engine/local.py's clients and an ingress's (serve/engine_client.py), whose
    `_stop` tells their core that a sequence is over here."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, byte_table: ByteTable | None, eos_token_id: int | None):
        self.tokenizer, self.byte_table, self.eos_token_id = tokenizer, byte_table, eos_token_id
        self.streams: dict[int, TextStream] = {}
        self._ids = itertools.count(1)
        self._deliver: Deliver | None = None
        # A core's thread takes outputs while consumers cancel: one at a time, so no event follows an end.
        self._lock = threading.RLock()

    def deliver_in_batches(self, deliver: Deliver) -> None:
        """Hand each step's events to `deliver` in one call, as (on_event, event) pairs: a server whose requests
        live on one event loop then hops there once per step. Set it before submitting."""
        self._deliver = deliver

    def open(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        output_kind: OutputKind = DELTA,
        stream_type: type[TextStream] | None = None,
    ) -> tuple[int, TextStream, GenerationParams]:
        """A new sequence's key and stream, and `params` as a core takes them: the seed fixed, for events to
        report it, and no stop strings, which are this side's (a core ends a sequence by token only).
        "final" `output_kind`: one event at the end (but with stop strings, which cut the text as it comes)."""
        sampling = params.sampling.resolved()
        assert sampling.seed is not None
        delta = output_kind == DELTA
        output = TextOutput(
            self.tokenizer, self.byte_table, params, self.eos_token_id, incremental_text and delta, delta
        )
        stream = (stream_type or TextStream)(
            on_event, output, len(prompt_ids), sampling.seed, params.logprobs is not None
        )
        key = next(self._ids)
        self.streams[key] = stream
        return key, stream, dataclasses.replace(params, stop=(), sampling=sampling)

    def take(self, output: StepOutput) -> None:
        """A core's step: each row into its sequence's events, handed over together."""
        batch: list[tuple[Callable[[Event], None], Event]] = []
        streams = self.streams
        keys, tokens, finished, logprobs = output
        finished = finished or _NONE_FINISHED
        with self._lock:
            for row, (key, token) in enumerate(zip(keys, tokens, strict=True)):
                stream = streams.get(key)
                if stream is None:
                    continue  # ended here already (a stop string, a cancel): the core's tail is dropped
                reason, error, _ = finished.get(row, _GOING_ON)
                event = stream.take(key, token, reason, error, None if logprobs is None else logprobs.get(row))
                if event is None:
                    continue
                if event.finish_reason is not None:
                    del streams[key]
                    self._ended(key, stream, reason is None)
                batch.append((stream.on_event, event))
            self._hand_over(batch)

    def cancel(self, key: int) -> None:
        """Stop a sequence: its "abort" event comes at once; its core frees its slot within a step."""
        self.end(key, "abort", None)

    def end(self, key: int, reason: str, error: str | None) -> None:
        """End a sequence here with no more tokens, and tell its core (if it was not over already)."""
        with self._lock:
            stream = self.streams.pop(key, None)
            if stream is None:
                return
            self._stop(key, stream)
            self._hand_over([(stream.on_event, stream.final(key, [], "", reason, error))])

    def _hand_over(self, batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        if not batch:
            return
        if self._deliver is not None:
            self._deliver(batch)
            return
        for on_event, event in batch:
            on_event(event)

    def _ended(self, key: int, stream: TextStream, stopped_here: bool) -> None:
        """A sequence had its last event; `stopped_here`: a stop string ended it, and its core would go on."""
        if stopped_here:
            self._stop(key, stream)

    def _stop(self, key: int, stream: TextStream) -> None:
        """Tell the core a sequence is over here."""
        raise NotImplementedError
