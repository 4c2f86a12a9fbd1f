"""The engine deployment: one replica per GPU (or GPU share), owning a model and its engine.

The ingress replicas (serve/app.py) do everything HTTP; this deployment only batches. Serve starts
its replicas, checks their health, replaces the dead ones, scales them (on the sequences they hold:
`record_autoscaling_stats`, serve/autoscaling.py) and routes the ingresses' calls to them. The work
itself does not go through Serve: `connect` has the engine open a token link to an ingress
(engine/link.py), and from then on that ingress sends its sequences to the engine's process and
gets their tokens back on the link, one message per engine step. `generate`, one Serve call per
sequence, is there for an ingress that has no link yet.

The engine runs in a child process (engine/process.py), so this replica's event loop and the
engine's loop never wait for each other's GIL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from ray import serve

from gpt2_platform.engine.config import EngineConfig
from gpt2_platform.engine.link import Address
from gpt2_platform.engine.process import EngineProcess
from gpt2_platform.engine.requests import Event, GenerationParams
from gpt2_platform.monitoring import exporter
from gpt2_platform.serve.autoscaling import ENGINE_SEQUENCES
from gpt2_platform.serve.metrics import ServeMetrics
from gpt2_platform.worker_process import configure_worker_logging, process_age_s

logger = logging.getLogger(__name__)


@serve.deployment(health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
class GPT2Engine:
    def __init__(
        self,
        model: str,
        tokenizer: str,
        config: EngineConfig,
        model_name: str,
        gpu_monitor: bool | None = None,
    ) -> None:
        age, started = process_age_s(), time.perf_counter()
        configure_worker_logging()  # Serve sets up its own loggers only: our start-up lines would be lost
        self.config, self.model_name = config, model_name
        # start() warms every batch and span shape (and captures the CUDA graphs) before it returns, so
        # the replica reports healthy only once it serves at full speed.
        self.engine = EngineProcess(model, tokenizer, config).start()
        self.max_seq_len = self.engine.max_seq_len
        self._loop: asyncio.AbstractEventLoop | None = None
        exporter.start_if_wanted(gpu_monitor)  # idempotent: the first replica on a node starts them
        self.metrics = ServeMetrics(model_name)
        self.metrics.start_sampling(self.engine.stats)
        # A replica's ready time is a target (docs/benchmarks.md): where it went, the engine process's share
        # in that process's own log line. As for a batch actor (batch/worker.py), a worker Ray started ahead
        # counts its idle time in its age.
        logger.info(
            "engine for %s from %s ready (%s), process %s: the engine process took %.1f s; this replica's "
            "process started %s before its constructor",
            model_name,
            model,
            config,
            self.engine.pid,
            time.perf_counter() - started,
            "?" if age is None else f"{age:.1f} s",
        )

    def connect(self, address: Address, authkey: bytes) -> None:
        """Open a token link to the ingress at `address` (nothing if there is one already)."""
        self.engine.connect(address, authkey)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads (serve/autoscaling.py:sequences_policy): the sequences this
        engine holds, running and waiting, however they came (Serve's own count sees only `generate`)."""
        stats = self.engine.stats()
        return {ENGINE_SEQUENCES: float(stats["running"] + stats["waiting"])}

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s: a dead engine process gets this replica replaced."""
        self.engine.check_health()

    def __del__(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.stop()
        if hasattr(self, "engine"):
            self.engine.shutdown()

    async def generate(
        self,
        outlet: tuple[Address, bytes, int],
        prompt_ids: list[int],
        params: GenerationParams,
        capacity: int | None,
    ) -> dict[str, Any]:
        """Run one sequence, its tokens going to `outlet`; returns how it ended once it has.

        Refused at once (`{"refused": ...}`) when the engine is busy and already holds `capacity`
        sequences (running and waiting): the ingress answers 429 rather than letting a queue grow.
        None: never refused (the rest of a request whose first sequence was admitted). Cancelling
        the call (the client went away) cancels the sequence.
        """
        stats = self.engine.stats()
        in_engine = stats["running"] + stats["waiting"]
        if capacity is not None and in_engine and in_engine + 1 > capacity:
            return {"refused": f"{stats['running']} sequences running, {stats['waiting']} waiting"}
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Event] = loop.create_future()

        def on_event(event: Event) -> None:  # the last event only: the tokens went to the ingress
            loop.call_soon_threadsafe(_settle, done, event)

        request_id = self.engine.submit(prompt_ids, params, on_event, tokens_only=True, outlet=outlet)
        try:
            event = await done
        except asyncio.CancelledError:
            self.engine.cancel(request_id)
            raise
        return {"finish_reason": event.finish_reason, "error": event.error}

    def stats(self) -> dict[str, Any]:
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id if context is not None else None
        return {
            **self.engine.stats(),
            "max_batch_size": self.config.max_batch_size,
            "replica": replica,
            "replica_pid": os.getpid(),
            "engine_pid": self.engine.pid,
        }

    def ping(self) -> int:
        """For an ingress that saw an engine fail: any answer means an engine serves again."""
        self.engine.check_health()
        return self.max_seq_len


def _settle(future: asyncio.Future, event: Event) -> None:
    if not future.done():
        future.set_result(event)
