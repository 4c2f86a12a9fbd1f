"""The engine process with text, for tests: what `EngineProcess` did itself before its child stopped making text.

`EngineProcess` (engine/process.py) hands back token ids only, as a token link does; its one user in the
package, the engine deployment, sends every sequence's tokens to an ingress, which makes the text. Tests
that compare text with an in-process engine wrap it here, making each event's text in this process with
engine/output.py's TextOutput, as an ingress does (serve/engine_client.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.output import TextOutput
from gpt2_platform.engine.process import EngineProcess
from gpt2_platform.engine.requests import Deliver, EngineConfig, Event, GenerationParams, LogprobStream, hand_over
from gpt2_platform.tokenizer import load_tokenizer


class _Texted:
    """One request's consumer: its tokens into text, with stop strings and log-probabilities, then `on_event`."""

    def __init__(self, on_event: Callable[[Event], None], output: TextOutput, logprobs: bool) -> None:
        self.on_event, self.output = on_event, output
        self.logprobs = LogprobStream() if logprobs else None
        self.done = False  # ended here (a stop string) before the engine's end

    def __call__(self, event: Event) -> None:
        texted = self.text(event)
        if texted is not None:
            self.on_event(texted)

    def text(self, event: Event) -> Event | None:
        """The event with text, or None for nothing to hand on now."""
        if self.done:
            return None  # a stop string ended it here: the engine's tail is dropped
        if self.logprobs is not None:
            self.logprobs.tokens.extend(event.logprobs or [])
            if event.prompt_logprobs is not None:
                self.logprobs.prompt = event.prompt_logprobs
        emitted = None
        for index, token in enumerate(event.token_ids):  # one token a delta event
            emitted = self.output.add(token, event.finished and index == len(event.token_ids) - 1)
        if not event.token_ids:  # ended with no token: aborted, failed or refused
            emitted = ([], "", event.finish_reason)
        if emitted is None:
            return None
        tokens, text, reason = emitted
        texted = Event(event.request_id, tokens, text, reason, seed=event.seed)
        if self.logprobs is not None:
            texted.logprobs, texted.prompt_logprobs = self.logprobs.take(len(tokens))
        if reason is not None:
            self.done = True
            texted.error, texted.prompt_tokens = event.error, event.prompt_tokens
            texted.completion_tokens = event.completion_tokens if event.finished else len(self.output.generated)
        return texted


class TextEngineProcess:
    """An `EngineProcess` whose events carry text; anything else is the process's own (pid, stats, cancel...)."""

    def __init__(
        self,
        model: str,
        tokenizer: str,
        config: EngineConfig,
        warmup: bool = True,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        self.process = EngineProcess(model, tokenizer, config, warmup=warmup, on_exit=on_exit)
        self._tokenizer_name = tokenizer
        self._deliver: Deliver | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.process, name)

    def start(self) -> TextEngineProcess:
        self.process.start()
        self.tokenizer = load_tokenizer(self._tokenizer_name)
        self.byte_table = ByteTable.of(self.tokenizer)
        self.process.deliver_in_batches(self._hand_over)
        return self

    def deliver_in_batches(self, deliver: Deliver) -> None:
        self._deliver = deliver

    def submit(
        self, prompt_ids: list[int], params: GenerationParams, on_event: Callable[[Event], None], incremental_text=True
    ) -> int:
        output = TextOutput(self.tokenizer, self.byte_table, params, self.tokenizer.eos_token_id, incremental_text)
        texted = _Texted(on_event, output, params.logprobs is not None)
        # Stop strings are applied here, on the text; the engine ends sequences by token only.
        return self.process.submit(prompt_ids, dataclasses.replace(params, stop=()), texted)

    def _hand_over(self, batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        """One step's events, with text, handed on together (to `deliver` where one was given)."""
        texted_batch = []
        for texted, event in batch:
            if not isinstance(texted, _Texted):  # submitted to `process` itself: its events as they are
                texted_batch.append((texted, event))
                continue
            was_done = texted.done
            new = texted.text(event)
            if new is None:
                continue
            if new.finished and not event.finished and not was_done:
                self.process.cancel(event.request_id)  # a stop string ended it: free its slot
            texted_batch.append((texted.on_event, new))
        hand_over(texted_batch, self._deliver)
