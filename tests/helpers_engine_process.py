"""The engine process behind the client every engine core has (engine/local.py), for tests: events with text
made in this process, as an ingress makes them for tokens that come over a token link."""

from __future__ import annotations

from collections.abc import Callable

from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.local import EngineClient
from gpt2_platform.engine.messages import StepOutput
from gpt2_platform.engine.process import EngineProcess
from gpt2_platform.engine.requests import EngineConfig


def process_client(
    model: str, tokenizer: str, config: EngineConfig, warmup: bool = True, on_exit: Callable[[str], None] | None = None
) -> EngineClient:
    """A started engine process and its client."""
    process = EngineProcess(model, tokenizer, config, warmup=warmup, on_exit=on_exit).start()
    assert process.tokenizer is not None  # start() loaded it
    return EngineClient(process, process.tokenizer, ByteTable.of(process.tokenizer), process.tokenizer.eos_token_id)


OWN_KEYS = 1_000_000
"""Keys from here on are a test's own, submitted to the core directly: a client numbers its own from 1."""


class CoreRows:
    """The rows of the sequences a test submits to a client's core itself, by key, as (token, its end or None,
    its log-probabilities or None); the rest of each output goes on to the client."""

    def __init__(self, client: EngineClient) -> None:
        self.rows: dict[int, list[tuple]] = {}
        self._client = client
        client.core.on_output = self

    def __call__(self, output: StepOutput) -> None:
        finished, logprobs = output.finished or {}, output.logprobs or {}
        mine = [row for row, key in enumerate(output.keys) if key >= OWN_KEYS]
        for row in mine:
            self.rows.setdefault(output.keys[row], []).append(
                (output.tokens[row], finished.get(row), logprobs.get(row))
            )
        self._client.take(output)

    def ended(self, key: int) -> bool:
        rows = self.rows.get(key)
        return bool(rows) and rows[-1][1] is not None

    def close(self) -> None:
        self._client.core.on_output = self._client.take
