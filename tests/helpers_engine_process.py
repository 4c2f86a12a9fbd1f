"""The engine process with text, for tests: what `EngineProcess` did itself before its child stopped making text.

`EngineProcess` (engine/process.py) hands back token ids only, as a token link does; its one user in the
package, the engine deployment, sends every sequence's tokens to an ingress, which makes the text. Tests
that compare text with an in-process engine wrap it here, making each event's text in this process with
engine/output.py's TextStream, as an ingress does (serve/engine_client.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.messages import RowLogprobs
from gpt2_platform.engine.output import TextOutput, TextStream
from gpt2_platform.engine.process import EngineProcess
from gpt2_platform.engine.requests import Deliver, EngineConfig, Event, GenerationParams, hand_over
from gpt2_platform.tokenizer import load_tokenizer


def _rows(event: Event) -> list[tuple[int, str | None, str | None, RowLogprobs | None]]:
    """An event of the process's as the rows a core sends (engine/messages.py, StepOutput): a token each, the
    last with the end; one row of token -1 for an end with no token."""
    tokens = event.token_ids or [-1]
    rows = []
    for index, token in enumerate(tokens):
        last = index == len(tokens) - 1
        row_logprobs = None
        if event.logprobs is not None or event.prompt_logprobs is not None:
            token_logprob = event.logprobs[index] if event.logprobs and token >= 0 else None
            row_logprobs = (token_logprob, event.prompt_logprobs if index == 0 else None)
        rows.append((token, event.finish_reason if last else None, event.error if last else None, row_logprobs))
    return rows


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
        seed = params.sampling.resolved().seed
        assert seed is not None
        stream = TextStream(on_event, output, len(prompt_ids), seed, params.logprobs is not None)
        # Stop strings are applied here, on the text; the engine ends sequences by token only.
        params = dataclasses.replace(params, stop=(), sampling=dataclasses.replace(params.sampling, seed=seed))
        return self.process.submit(prompt_ids, params, _Streamed(stream))

    def _hand_over(self, batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        """One step's events, with text (as an ingress makes it), handed on together (to `deliver` where one
        was given)."""
        texted_batch = []
        for streamed, event in batch:
            if not isinstance(streamed, _Streamed):  # submitted to `process` itself: its events as they are
                texted_batch.append((streamed, event))
                continue
            for token, reason, error, row_logprobs in _rows(event):
                if streamed.done:
                    break  # a stop string ended it here: the engine's tail is dropped
                new = streamed.stream.take(event.request_id, token, reason, error, row_logprobs)
                if new is None:
                    continue
                if new.finished:
                    streamed.done = True
                    if reason is None:
                        self.process.cancel(event.request_id)  # a stop string ended it: free its slot
                texted_batch.append((streamed.stream.on_event, new))
        hand_over(texted_batch, self._deliver)


class _Streamed:
    """The process's `on_event` for a sequence submitted here: its events come through `_hand_over`."""

    def __init__(self, stream: TextStream) -> None:
        self.stream, self.done = stream, False

    def __call__(self, event: Event) -> None:
        raise AssertionError("events come through deliver_in_batches")
