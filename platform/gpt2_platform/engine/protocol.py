"""The one interface every engine meets: what a server or a batch job may call, wherever the engine runs.

The client of an engine core (engine/local.py: `LocalEngine` for an `Engine` in this process, `EngineClient`
over an `EngineProcess`) and `RemoteEngine` (an engine deployment seen from an ingress replica,
serve/engine_client.py) satisfy it, so the code in front of an engine does not change with where it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from gpt2_platform.engine.requests import Deliver, Event, GenerationParams


@runtime_checkable
class GenerationEngine(Protocol):
    max_seq_len: int
    """Prompt plus generated tokens per sequence."""

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot take requests."""

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raise ValueError, naming what is wrong, for a request the engine cannot take."""

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        request_size: int = 1,
    ) -> int:
        """Queue one sequence; `on_event` gets its events, the last one with a finish reason.

        `request_size`: a request's sequences are submitted together, the first with their number
        and the rest with 0. An engine that refuses work when full (RemoteEngine: a "refused"
        event) decides for all of them at the first; one that never refuses ignores it."""

    def cancel(self, request_id: int) -> None:
        """Stop a sequence; its slot is free within a step."""

    def deliver_in_batches(self, deliver: Deliver) -> None:
        """Hand each engine step's events to `deliver` in one call, instead of one callback per event."""

    def stats(self) -> dict[str, Any]:
        """Counters of what the engine holds and did."""

    def shutdown(self) -> None:
        """Stop the engine; sequences still pending end with an error event."""
