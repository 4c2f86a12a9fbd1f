"""The client of an engine core, in this process or in its own: the engine interface (engine/protocol.py),
its events and their text made here (engine/output.py). A core takes `SubmitRequest`s under its client's
keys and hands back every sequence's output, its end included however it ends, one `StepOutput` a step
(`on_output`): `EngineProcess` (engine/process.py), or `InProcessCore` here for an `Engine` in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpt2_platform.engine.messages import DELTA, OutputKind, StepOutput, StepSink, SubmitRequest
from gpt2_platform.engine.output import OutputProcessor, TextStream
from gpt2_platform.engine.requests import Event, GenerationParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gpt2_platform.engine.detokenize import ByteTable
    from gpt2_platform.engine.engine import Engine
    from gpt2_platform.engine.process import EngineProcess


class EngineClient(OutputProcessor):
    """The engine interface over a core: requests in as `SubmitRequest`s, the core's output out as events."""

    def __init__(
        self,
        core: InProcessCore | EngineProcess,
        tokenizer: PreTrainedTokenizerBase,
        byte_table: ByteTable | None,
        eos_token_id: int | None,
    ) -> None:
        super().__init__(tokenizer, byte_table, eos_token_id)
        self.core = core
        core.on_output = self.take
        engine = core.engine if isinstance(core, InProcessCore) else core
        assert engine.max_seq_len is not None, "start the engine process first"
        self.max_seq_len: int = engine.max_seq_len
        # What is not about one sequence is the engine's own.
        self.check_health, self.validate, self.stats = engine.check_health, engine.validate, engine.stats
        self.shutdown = engine.shutdown

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        request_size: int = 1,
        output_kind: OutputKind = DELTA,
    ) -> int:
        """Queue one sequence; `on_event` gets its events on the core's thread (or through `deliver`).

        `incremental_text` False (and no stop strings): the text comes whole with the last event. "final"
        `output_kind`: one event at the end, the core holding the tokens till then. `request_size` is the
        interface's: these cores never refuse, so it is ignored."""
        key, _, core_params = self.open(prompt_ids, params, on_event, incremental_text, output_kind)
        kind = DELTA if params.stop else output_kind  # a stop string is found as the tokens come
        try:
            self.core.submit(SubmitRequest(key, list(prompt_ids), core_params, kind))
        except BaseException:
            self.streams.pop(key, None)
            raise
        return key

    def _stop(self, key: int, stream: TextStream) -> None:
        self.core.cancel(key)


class LocalEngine(EngineClient):
    """The client of an `Engine` in this process."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(InProcessCore(engine), engine.tokenizer, engine.byte_table, engine.eos_token_id)


class InProcessCore(StepSink):
    """An `Engine` in this process as a core: the sink of every sequence its client submits."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.on_output: Callable[[StepOutput], None] | None = None

    def send_output(self, output: StepOutput) -> bool:
        if self.on_output is not None:
            self.on_output(output)
        return True
