"""The engine deployment: one replica per GPU (or GPU share), owning a model and its engine.

The ingress replicas (serve/app.py) do everything HTTP; this deployment only batches. Serve starts, checks,
replaces, scales (`record_autoscaling_stats`, serve/autoscaling.py) and routes to its replicas, but the work
does not go through Serve: `connect` has the engine open a token link to an ingress (engine/link.py), which
then sends its sequences to the engine's process and gets their tokens back, one message per engine step.
`generate`, one Serve call per sequence, is for an ingress that has no link yet.

The engine runs in a child process (engine/process.py), so this replica's event loop and the engine's loop
never wait for each other's GIL. A replica whose engine process exits exits too, at once: Serve replaces a
crashed replica at its next health check, where one that only fails its checks would wait for several,
answering every call with a traceback meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from typing import Any

import ray
from ray import serve

from gpt2_platform.engine.config import EngineConfig
from gpt2_platform.engine.messages import Address, Finish, StepOutput, SubmitRequest
from gpt2_platform.engine.process import EngineProcess
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
        self._keys = itertools.count(1)
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Finish]]] = {}  # by key, for `generate`
        self.engine = EngineProcess(model, tokenizer, config, on_output=self._ended, on_exit=self._engine_exited)
        # start() warms every batch and span shape (and captures the CUDA graphs) before it returns, so
        # the replica reports healthy only once it serves at full speed.
        self.engine.start()
        assert self.engine.max_seq_len is not None  # start() returns once the engine reported it
        self.max_seq_len: int = self.engine.max_seq_len
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

    def _engine_exited(self, why: str) -> None:
        """On the engine process's reader thread, the moment the engine process is gone: end this replica."""
        # At once: any call that reached this replica from now on would fail with a traceback in its log. The
        # pending `generate` calls end with Ray's "actor died", which their callers turn into a 503.
        logger.error("engine for %s failed (%s): this replica exits for Serve to replace it", self.model_name, why)
        _exit_process()

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

    async def generate(self, request: SubmitRequest) -> dict[str, Any]:
        """Run one sequence, its tokens going to `request.link`; returns how it ended once it has: refused
        (`{"refused": ...}`, the ingress answers 429 with its Retry-After) where the engine process would not
        start it within `request.admission`'s wait budget. Cancelling the call cancels the sequence."""
        loop = asyncio.get_running_loop()
        key = next(self._keys)  # not the ingress's key: ingresses' keys overlap
        done: asyncio.Future[Finish] = loop.create_future()
        self._calls[key] = (loop, done)
        try:
            self.engine.submit(request._replace(key=key))
            reason, error, _ = await done
        except asyncio.CancelledError:
            self.engine.cancel(key)
            raise
        finally:
            self._calls.pop(key, None)
        if reason == "refused":
            return {"refused": error}
        return {"finish_reason": reason, "error": error}

    def _ended(self, output: StepOutput) -> None:
        """On the engine process's reader thread: how `generate`'s sequences ended (their tokens went to links)."""
        for row, end in (output.finished or {}).items():
            call = self._calls.get(output.keys[row])
            if call is not None:
                call[0].call_soon_threadsafe(_settle, call[1], end)

    def stats(self) -> dict[str, Any]:
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id if context is not None else None
        return {
            **self.engine.stats(),  # the engine's max_batch_size: the number it chose, where auto
            "replica": replica,
            "replica_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),  # where it runs, on a cluster
            "engine_pid": self.engine.pid,
        }

    def ping(self) -> int:
        """For an ingress that saw an engine fail: any answer means an engine serves again."""
        self.engine.check_health()
        return self.max_seq_len


def _exit_process() -> None:
    """End this replica's actor as Ray's own `ray.kill` does, so the raylet reports an intended kill rather
    than a worker that crashed; an exit of the process where that fails."""
    import ray

    sys.stdout.flush()
    sys.stderr.flush()  # where this package's log lines go in a Ray worker (configure_worker_logging)
    try:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    except Exception as error:  # not as an actor (a test), or Ray is going away: exit all the same
        logger.warning("could not end this replica through Ray (%r); exiting its process", error)
        os._exit(1)  # not sys.exit: this is the engine's reader thread, and Ray's worker loop holds the main one


def _settle(future: asyncio.Future, end: Finish) -> None:
    if not future.done():
        future.set_result(end)
