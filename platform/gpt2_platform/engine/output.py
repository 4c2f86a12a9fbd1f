"""Output processing: a sequence's tokens turned into the text a client sees.

The scheduler (engine.py) decides only what ends a sequence on the device's side: its end-of-text
token and its token budget. Everything about text is here: incremental detokenizing, stop strings
(which end a sequence early), and holding back a tail that could still grow into one. The split is
vLLM's: its engine core emits token ids and its API servers turn them into text, so the per-token
text work runs in the processes that serve HTTP, spread over the machine's cores, and not in the one
process that feeds the GPU. The in-process engine runs the same code on its own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpt2_platform.engine.detokenize import ByteTable, IncrementalDetokenizer, find_stop
from gpt2_platform.engine.messages import RowLogprobs
from gpt2_platform.engine.requests import Event, GenerationParams, LogprobStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextOutput:
    """One sequence's text as its tokens arrive.

    `add` takes each generated token with what the scheduler knows about it, and returns what to
    emit: the token ids, the new text, and the finish reason (None while the sequence goes on).
    With `incremental` False (and no stop strings) only the first token is announced (no ids, no
    text: a server still learns when its first token came), then nothing until the end, when the
    whole text is decoded at once: detokenizing every token of a large batch costs more host time
    than the device step, and a caller that wants only the result need not pay it.
    """

    __slots__ = ("detokenizer", "tokenizer", "stop", "hold", "incremental", "generated", "emitted_chars", "eos_id")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        byte_table: ByteTable | None,
        params: GenerationParams,
        eos_token_id: int | None,
        incremental: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, byte_table)
        self.stop = tuple(params.stop)
        self.hold = max((len(stop) - 1 for stop in self.stop), default=0)
        self.incremental = incremental or bool(self.stop)
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
                return ([], "", None) if len(self.generated) == 1 else None
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
