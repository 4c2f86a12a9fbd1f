"""The inference engine: continuous batching over a static KV cache.

One background thread owns the model. Each iteration it admits waiting requests into free cache slots (a
batched prefill that yields their first token), then runs one decode step for every running sequence, so
nobody waits for a batch to drain. `Engine.submit`, from any thread, takes the typed request
(engine/messages.py) and puts token records into a sink, no text: that is the clients' (engine/local.py),
and `generate()`'s (engine/collect.py), which blocks on a block of requests (Ray Data).

This module is the facade and the loop; the slots' bookkeeping is scheduler.py's, the per-step output
delivery.py's, and what `auto` settings resolve to resolve.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from gpt2_platform.engine.admission import Admission, Refusal
from gpt2_platform.engine.collect import CompletionSink
from gpt2_platform.engine.config import SAMPLING_MODES
from gpt2_platform.engine.delivery import Delivery
from gpt2_platform.engine.detokenize import ByteTable, TableTokenizer
from gpt2_platform.engine.messages import DELTA, FINAL_ONLY, SubmitRequest
from gpt2_platform.engine.requests import (
    Completion,
    EngineConfig,
    EngineDeadError,
    Event,
    GenerationParams,
    LogprobStream,
    TokenSink,
    validate_request,
)
from gpt2_platform.engine.resolve import (
    default_compile,
    resolve_decode_kernels,
    resolve_dtype,
    resolve_max_batch_size,
    use_compile_cache,
)
from gpt2_platform.engine.runner import ModelRunner
from gpt2_platform.engine.scheduler import Iteration, Scheduler, Sequence
from gpt2_platform.model import GPT2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Many modules import these from here: the engine's own names and the request types it takes.
__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "Event",
    "GenerationParams",
    "default_compile",
    "resolve_decode_kernels",
    "resolve_dtype",
    "resolve_max_batch_size",
    "use_compile_cache",
]

logger = logging.getLogger(__name__)


class Engine:
    """The engine core in this process: submit, cancel, generate and stats from any thread; one loop
    thread runs the scheduler and the model and puts the output into each request's sink."""

    def __init__(
        self,
        model: GPT2,
        tokenizer: PreTrainedTokenizerBase | TableTokenizer,
        config: EngineConfig,
        device: torch.device | None = None,
    ) -> None:
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if config.compile_cache_dir is not None:
            use_compile_cache(config.compile_cache_dir)
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        # None: every token goes through the tokenizer
        self.byte_table = tokenizer.table if isinstance(tokenizer, TableTokenizer) else ByteTable.of(tokenizer)
        self.max_seq_len = config.max_seq_len or model.config.n_positions
        decode_kernels = resolve_decode_kernels(config.decode_kernels, device, model.config)
        dtype = resolve_dtype(config.dtype, device)
        self.max_batch_size, self.max_batch_size_reason = resolve_max_batch_size(
            config, model, self.max_seq_len, dtype, device
        )
        logger.info("engine.max_batch_size %d (%s)", self.max_batch_size, self.max_batch_size_reason)
        self.runner = ModelRunner(
            model,
            self.max_batch_size,
            self.max_seq_len,
            dtype,
            device,
            config.cuda_graphs,
            compile_step=default_compile(device, decode_kernels) if config.compile is None else config.compile,
            vocab_limit=len(tokenizer),
            decode_kernels=decode_kernels,
            packed_prefill=config.packed_prefill,
        )
        if self.runner.vocab_limit < model.config.vocab_size:
            logger.info(
                "sampling only ids below %d: the tokenizer has %d tokens, the model %d",
                self.runner.vocab_limit,
                len(tokenizer),
                model.config.vocab_size,
            )
        self._ids = itertools.count(1)
        self.scheduler = Scheduler(self.runner, self.max_batch_size, self.max_seq_len, config.max_prefill_tokens)
        self.delivery = Delivery(self.scheduler)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._in_flight: Iteration | None = None  # what the last iteration started, not yet taken in

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, warmup: bool = True, modes: tuple[str, ...] = SAMPLING_MODES, warm_prefills: bool = True) -> Engine:
        """Warm every shape (of the sampling `modes` the work will use), then start the loop thread.

        `warm_prefills`: False leaves the prefill graphs to their first use (ModelRunner.warmup).
        """
        if warmup:
            self.runner.warmup(modes, prefills=warm_prefills)
        if self.config.gil_switch_interval_ms is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_ms / 1000)
        self._thread = threading.Thread(target=self._run, name="gpt2-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop has died."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    # ---- submitting --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raise ValueError for a request the engine cannot take, naming what is wrong."""
        validate_request(prompt_ids, params, self.max_seq_len, self.runner.model.config.vocab_size)

    def submit(self, request: SubmitRequest, sink: TokenSink) -> int:
        """The core's entry: queue `request`'s sequence, its output to `sink` as records under `request.key`
        (engine/requests.py, TokenRecord). "delta": a record per token as it comes. "final": the sequence is
        held quietly (its tokens taken in a step at a time with numpy, no Python per token) and its records
        come in one run at its end; one asking for log-probabilities or echo goes as "delta". No text here:
        the engine ends a sequence at end-of-text, its token budget or a cancel, and stop strings are the
        consumer's (engine/output.py's TextOutput). `admission` and `link` are the engine process's."""
        self.check_health()
        params = dataclasses.replace(request.params, stop=(), sampling=request.params.sampling.resolved())
        self.validate(request.prompt_ids, params)
        quiet = request.output_kind == FINAL_ONLY and not (params.echo or params.logprobs is not None)
        stop_token = -1 if params.ignore_eos or self.eos_token_id is None else self.eos_token_id
        sequence = Sequence(
            next(self._ids), list(request.prompt_ids), params, sink, request.key,
            max_tokens=params.max_tokens, stop_token=stop_token, quiet=quiet, submitted_at=time.perf_counter(),
            logprobs=None if params.logprobs is None else LogprobStream(), seed=params.sampling.seed or 0,
        )  # fmt: skip
        self.scheduler.add(sequence)
        return sequence.request_id

    def cancel(self, request_id: int) -> None:
        """Stop a request (a client went away); its slot is free after the current step."""
        self.scheduler.cancel(request_id)

    def generate(self, prompts: list[list[int]], params: list[GenerationParams] | GenerationParams) -> list[Completion]:
        """Run many requests to the end and return them in order (blocking); their text is made on this
        thread (engine/collect.py), but for stop strings, cut on the engine's as their tokens come."""
        if isinstance(params, GenerationParams):
            params = [params] * len(prompts)
        if not prompts:
            return []
        params = [dataclasses.replace(p, sampling=p.sampling.resolved()) for p in params]  # Completion.seed
        sink = CompletionSink(self, params)
        for key, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            sink.submit(SubmitRequest(key, prompt, p, DELTA if p.stop else FINAL_ONLY))
        while not sink.wait(timeout_s=1.0):
            self.check_health()
        return sink.completions(prompts)

    def stats(self) -> dict:
        """Counters since start. `queue_s` and `first_token_s` sum, over the `first_tokens` sequences that
        have had a token, the seconds from submit to admission and from admission to that first token;
        `idle_s` is the loop's time with nothing to run."""
        scheduler, delivery = self.scheduler, self.delivery
        return {
            "steps": scheduler.num_steps,
            "prefills": scheduler.num_prefills,
            "packed_prefills": self.runner.packed_prefills,
            "prompt_tokens": scheduler.num_prompt_tokens,
            "generated_tokens": delivery.num_generated_tokens,
            "finished": delivery.num_finished,
            "running": scheduler.num_running(),
            "waiting": len(scheduler.waiting),
            "max_batch_size_seen": max(scheduler.batch_sizes, default=0),
            "queue_s": scheduler.queue_s,
            "first_token_s": delivery.first_token_s,
            "first_tokens": delivery.num_first_tokens,
            "idle_s": scheduler.idle_s,
            "captures_on_use": self.runner.captures_on_use,
            "capture_on_use_s": self.runner.capture_on_use_s,
            "batch_sizes": dict(sorted(scheduler.batch_sizes.items())),
            "drain_per_s": scheduler.drain_per_s(),
            "drain_measured_per_s": scheduler.drain.per_s(),
            "step_s": scheduler.step_s,
            "max_batch_size": self.max_batch_size,
            "max_batch_size_reason": self.max_batch_size_reason,
        }

    def refusal(self, admission: Admission) -> Refusal | None:
        """None if a request may join now under `admission` (engine/admission.py), else why not."""
        return self.scheduler.refusal(admission)

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        scheduler, delivery = self.scheduler, self.delivery
        try:
            while True:
                cancelled = scheduler.wait_for_work(self._in_flight is not None)
                if cancelled is None:
                    return
                # A waiting one ends too, with no tokens: a consumer counting what it sent (a token link's
                # sequences in flight) must see every sequence end.
                for sequence in scheduler.drop_cancelled(cancelled):
                    delivery.finish(sequence, "abort")
                # Start this iteration's prefill and decode step before taking in the last one's tokens:
                # the device computes while the host delivers, and nothing here waits for the device but
                # that intake, so the host's work per step stays off the critical path.
                prefill = scheduler.admit()
                launched = scheduler.launch()
                in_flight, self._in_flight = self._in_flight, None
                delivery.collect(in_flight)
                if prefill is not None or launched is not None:
                    self._in_flight = Iteration(prefill, launched)
                if launched is not None:
                    scheduler.time_step()
                delivery.flush()
        except BaseException as error:  # the loop must report any failure to every waiting caller
            logger.exception("engine loop failed")
            self._error = error
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for sequence in self.scheduler.take_all():
            try:
                self.delivery.finish(sequence, "error", error=f"engine failed: {error!r}")
            except Exception:  # a consumer's callback must not hide the original failure
                logger.exception("could not deliver the engine failure to request %d", sequence.request_id)
        try:
            self.delivery.flush()
        except Exception:
            logger.exception("could not deliver the engine failure")
