"""The inference engine: continuous batching over a static KV cache.

One background thread owns the model. Each iteration it admits waiting
requests into free cache slots (a batched prefill that yields their first
token), then runs one decode step for every running sequence. A request joins
at the next step and leaves the step it finishes, so nobody waits for a batch
to drain. Consumers submit from any thread and get events back through a
callback; `generate()` wraps that to block (Ray Data).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpt2_platform.engine import kernels
from gpt2_platform.engine.admission import Admission, DrainRate, Refusal, decide
from gpt2_platform.engine.buffers import Launch
from gpt2_platform.engine.config import SAMPLING_MODES, auto_batch_size
from gpt2_platform.engine.detokenize import ByteTable, TableTokenizer
from gpt2_platform.engine.output import TextOutput
from gpt2_platform.engine.requests import (
    Completion,
    Deliver,
    EngineConfig,
    EngineDeadError,
    Event,
    GenerationParams,
    LogprobStream,
    TokenSink,
    logprob_entries,
    validate_request,
)
from gpt2_platform.engine.runner import ModelRunner
from gpt2_platform.model import GPT2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    request_id: int
    prompt: list[int]
    params: GenerationParams
    on_event: Callable[[Event], None] | None  # None: a sink's sequence that no one else waits on
    output: TextOutput | None  # None: events carry tokens only, and the consumer makes the text
    sink: TokenSink | None = None  # takes its tokens as records, with no Event each
    sink_key: int = 0
    slot: int = -1
    # Its tokens so far; a quiet sequence's stay in the engine's token table until it finishes.
    generated: list[int] = field(default_factory=list)
    # From params, read once per token: the budget, and end-of-text (-1 when it is ignored).
    max_tokens: int = 0
    stop_token: int = -1
    # Quiet: its consumer wants only the end (generate() without stop strings), so its tokens are taken in
    # a whole step at a time with numpy, and no Python runs for it per token.
    quiet: bool = False
    # With params.logprobs: its tokens' (and with echo its prompt's), until events or records carry them.
    logprobs: LogprobStream | None = None
    submitted_at: float = 0.0  # time.perf_counter(), for stats()
    admitted_at: float = 0.0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def resolve_max_batch_size(
    config: EngineConfig, model: GPT2, max_seq_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, str]:
    """The engine's slots and why: the number configured, or `auto`'s choice from the device's memory."""
    if config.max_batch_size != "auto":
        return config.max_batch_size, "engine.max_batch_size"
    on_gpu = device.type == "cuda"
    total = free = 0
    weights = 0
    element = torch.empty((), dtype=dtype).element_size()
    if on_gpu:
        free, total = torch.cuda.mem_get_info(device)
        weights = sum(p.numel() for p in model.parameters() if p.device.type != "cuda") * element
    c = model.config
    # Keys and values of every layer for max_seq_len tokens, and the sampler's fp32 rows over the vocabulary.
    per_slot = 2 * c.n_layer * c.n_embd * max_seq_len * element + 4 * c.vocab_size * 4
    return auto_batch_size(on_gpu, total, free, weights, per_slot, config.gpu_memory_share)


def resolve_decode_kernels(name: str, device: torch.device, model_config=None) -> str:
    problem = kernels.unsupported(model_config) if model_config is not None else None
    if name == "auto":
        return "triton" if device.type == "cuda" and kernels.available() and problem is None else "torch"
    if name == "triton" and problem:
        raise ValueError(f"decode_kernels='triton': {problem}; use 'torch' or 'auto'")
    if name == "triton" and not kernels.available():
        raise ValueError("decode_kernels='triton' needs the triton package (pip install triton); or use 'torch'")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "decode_kernels='triton' runs on CUDA GPUs (or in Triton's interpreter, TRITON_INTERPRET=1); "
            f"this engine is on {device.type}: use 'torch' or 'auto'"
        )
    return name


def use_compile_cache(directory: str) -> None:
    """Point this process's Triton kernel cache and torch.compile's (inductor's) caches into `directory`.

    Both read their variable whenever they compile, so this holds for every kernel compiled after it (the
    engine compiles only at warm-up and on first use, after its constructor); the variables also reach
    the processes inductor compiles in.
    """
    root = Path(directory).expanduser().resolve()
    for variable, name in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        path = root / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"engine.compile_cache_dir {directory}: cannot make {path} ({error.strerror}); point it at a "
                "writable directory or set it to null"
            ) from error
        os.environ[variable] = str(path)


def default_compile(device: torch.device, decode_kernels: str) -> bool:
    """What `engine.compile: null` means: compile the model's modules on a GPU, where it fuses a step's
    small kernels; not with our decode kernels, where it would compile only the token pick, which makes
    a step a few percent faster while dynamo's import and traces add seconds to every replica's start
    (docs/benchmarks/2026-12-03-s19-batch-h200.md); not on a CPU (minutes of warm-up)."""
    return device.type == "cuda" and decode_kernels == "torch"


class Engine:
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
        self._waiting: deque[_Sequence] = deque()
        self._cancelled: set[int] = set()
        self._slots: list[_Sequence | None] = [None] * self.max_batch_size
        # What a step needs of each slot, as arrays: at hundreds of sequences a step, a Python loop over them
        # to launch the step and another to take its tokens in cost more host time than the device's step
        # (the batch job's py-spy profile, docs/benchmarks.md).
        slots = self.max_batch_size
        self._occupant = np.zeros(slots, np.int64)  # the request id in the slot, 0 when free
        self._launched = np.zeros(slots, np.int64)  # tokens started on the device (prefill, then a step each)
        self._budget = np.zeros(slots, np.int64)  # max_tokens
        self._prompt_len = np.zeros(slots, np.int64)
        self._quiet = np.zeros(slots, bool)
        self._taken = np.zeros(slots, np.int64)  # a quiet sequence's tokens taken in
        self._stop_token = np.full(slots, -1, np.int64)
        self._admitted_at = np.zeros(slots)
        self._table = np.zeros((slots, self.max_seq_len), np.int32)  # a quiet sequence's tokens, by slot
        self._wakeup = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # With deliver_in_batches: the events of one loop iteration, handed over together at its end.
        self._deliver: Deliver | None = None
        self._outbox: list[tuple[Callable[[Event], None], Event]] = []
        self._sinks: set[TokenSink] = set()  # the sinks that took records this iteration
        self._in_flight: _Iteration | None = None  # what the last iteration started, not yet taken in
        # Counters, read by stats(): how the engine actually batched its work.
        self.num_steps = 0
        self.num_prefills = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.batch_sizes: Counter[int] = Counter()
        # Where a request's time to first token goes inside the engine, summed over sequences: waiting
        # for a slot (submit to admission), then its prefill and the step that hands the token out.
        self.queue_s = 0.0
        self.first_token_s = 0.0
        self.num_first_tokens = 0
        self.idle_s = 0.0  # the loop waiting with nothing queued or running: work did not come fast enough
        self.drain = DrainRate()  # how fast waiting sequences start: what admission promises a wait from
        self.step_s = 0.0  # a decode step's seconds while busy (moving mean): the modelled drain rate's clock
        self._last_step_at: float | None = None

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
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop has died."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    def deliver_in_batches(self, deliver: Deliver) -> None:
        """Hand each loop iteration's events to `deliver` in one call, as (on_event, event) pairs.

        By default every event calls its request's `on_event` on the engine thread. A server whose
        requests live on one event loop passes a function that makes a single hop to that loop for
        all of a step's events, then calls the callbacks there: one wake-up per step instead of one
        per token per request. Set it before submitting.
        """
        self._deliver = deliver

    # ---- submitting --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raise ValueError for a request the engine cannot take, naming what is wrong."""
        validate_request(prompt_ids, params, self.max_seq_len, self.runner.model.config.vocab_size)

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None] | None,
        incremental_text: bool = True,
        tokens_only: bool = False,
        request_size: int = 1,
        sink: TokenSink | None = None,
        sink_key: int = 0,
        final_only: bool = False,
    ) -> int:
        """Queue a request; `on_event` is called from the engine thread with each step's output.

        With `incremental_text=False` (and no stop strings) events carry tokens only and the
        whole text comes with the last one: detokenizing every token of a large batch costs
        more host time than the GPU step itself. With `tokens_only` every event carries its token
        and no text, and stop strings are the consumer's to apply (engine/output.py's TextOutput,
        e.g. in the process serving HTTP): the engine ends a sequence only at end-of-text or its
        token budget, or when cancelled. With a `sink` (tokens only), each token goes to the sink as
        a record under `sink_key` instead, and `on_event`, if given, gets only the last event, with no
        tokens. `request_size` is the interface's (engine/protocol.py): this engine queues whatever it
        is given, so it ignores it. With `final_only` (and no stop strings, sink or `tokens_only`), the
        sequence is quiet: `on_event` gets one event, at the end, with every token and no text (the
        consumer decodes it; `generate()` does), and the engine spends no Python on it per token.
        """
        self.check_health()
        params = dataclasses.replace(params, stop=tuple(params.stop), sampling=params.sampling.resolved())
        self.validate(prompt_ids, params)
        assert on_event is not None or sink is not None, "a sequence needs an on_event or a sink"
        plain = not (params.stop or params.echo or params.logprobs is not None)
        quiet = final_only and plain and not tokens_only and sink is None
        output = None
        if not tokens_only and sink is None and not quiet:
            output = TextOutput(self.tokenizer, self.byte_table, params, self.eos_token_id, incremental_text)
        stop_token = -1 if params.ignore_eos or self.eos_token_id is None else self.eos_token_id
        sequence = _Sequence(
            next(self._ids), list(prompt_ids), params, on_event, output, sink, sink_key,
            max_tokens=params.max_tokens, stop_token=stop_token, quiet=quiet, submitted_at=time.perf_counter(),
            logprobs=None if params.logprobs is None else LogprobStream(),
        )  # fmt: skip
        with self._wakeup:
            self._waiting.append(sequence)
            self._wakeup.notify()
        return sequence.request_id

    def cancel(self, request_id: int) -> None:
        """Stop a request (a client went away); its slot is free after the current step."""
        with self._wakeup:
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def generate(self, prompts: list[list[int]], params: list[GenerationParams] | GenerationParams) -> list[Completion]:
        """Run many requests to the end and return them in order (blocking)."""
        if isinstance(params, GenerationParams):
            params = [params] * len(prompts)
        done = threading.Semaphore(0)
        results: dict[int, list[Event]] = {}

        def collect(event: Event) -> None:
            results.setdefault(event.request_id, []).append(event)
            if event.finished:
                done.release()

        ids = [
            self.submit(prompt, p, collect, incremental_text=False, final_only=True)
            for prompt, p in zip(prompts, params, strict=True)
        ]
        for _ in ids:
            while not done.acquire(timeout=1.0):
                self.check_health()
        completions = [self._completion(results[i]) for i in ids]
        # Quiet sequences: the text is ours to decode, on this thread. Through the byte table where there is one
        # (it decodes as the tokenizer does, checked when built): a batch job decodes a whole block's
        # completions here at once, and the tokenizer's per-call conversions held the GIL, which the engine's
        # thread needs every step, for most of that time (py-spy --gil of the job's actor, docs/benchmarks.md).
        decode = self.tokenizer.decode if self.byte_table is None else self.byte_table.decode
        for completion, p in zip(completions, params, strict=True):
            if not p.stop and completion.error is None:
                completion.text = decode(completion.token_ids)
        return completions

    @staticmethod
    def _completion(events: list[Event]) -> Completion:
        last = events[-1]
        asked = any(e.logprobs is not None for e in events)
        return Completion(
            prompt_logprobs=next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None),
            logprobs=[lp for e in events for lp in e.logprobs or ()] if asked else None,
            token_ids=[t for e in events for t in e.token_ids],
            text="".join(e.text for e in events),
            finish_reason=last.finish_reason or "error",
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            seed=last.seed,
            error=last.error,
        )

    def stats(self) -> dict:
        """Counters since start. `queue_s` and `first_token_s` sum, over the `first_tokens` sequences that
        have had a token, the seconds from submit to admission and from admission to that first token;
        `idle_s` is the loop's time with nothing to run."""
        running = int(np.count_nonzero(self._occupant))
        return {
            "steps": self.num_steps,
            "prefills": self.num_prefills,
            "packed_prefills": self.runner.packed_prefills,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "finished": self.num_finished,
            "running": running,
            "waiting": len(self._waiting),
            "max_batch_size_seen": max(self.batch_sizes, default=0),
            "queue_s": self.queue_s,
            "first_token_s": self.first_token_s,
            "first_tokens": self.num_first_tokens,
            "idle_s": self.idle_s,
            "captures_on_use": self.runner.captures_on_use,
            "capture_on_use_s": self.runner.capture_on_use_s,
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "drain_per_s": self.drain_per_s(),
            "drain_measured_per_s": self.drain.per_s(),
            "step_s": self.step_s,
            "max_batch_size": self.max_batch_size,
            "max_batch_size_reason": self.max_batch_size_reason,
        }

    def refusal(self, admission: Admission) -> Refusal | None:
        """None if a request may join now under `admission` (engine/admission.py), else why not."""
        running = int(np.count_nonzero(self._occupant))
        return decide(running, len(self._waiting), len(self._slots), self.drain_per_s(), admission)

    def drain_per_s(self) -> float:
        """Sequences a second the slots should start, for admission: the rate measured over the last window,
        or, where more, the one modelled from the step time and the lengths the slots hold (every slot
        frees once its sequence has run its max_tokens). The measured rate counts demand as much as slots:
        after a quiet spell (or at start) it is low whatever the slots could do, and would refuse a burst
        the engine drains in a moment; the model ignores sequences that stop early, so it errs low too,
        and the higher of the two is the better estimate."""
        measured = self.drain.per_s()
        occupied = self._occupant != 0
        if self.step_s <= 0 or not occupied.any():
            return measured
        mean_tokens = float(self._budget[occupied].mean())
        return max(measured, len(self._slots) / (max(mean_tokens, 1.0) * self.step_s))

    def _time_step(self) -> None:
        now = time.perf_counter()
        if self._last_step_at is not None:
            elapsed = now - self._last_step_at
            self.step_s = elapsed if self.step_s == 0 else 0.9 * self.step_s + 0.1 * elapsed
        self._last_step_at = now

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    if not self._stopping and not self._waiting and not self._has_running():
                        idle_from = time.perf_counter()
                        while not self._stopping and not self._waiting and not self._has_running():
                            self._wakeup.wait()
                        self.idle_s += time.perf_counter() - idle_from
                        self._last_step_at = None  # an idle gap is no step
                    if self._stopping:
                        return
                    cancelled, self._cancelled = self._cancelled, set()
                self._drop_cancelled(cancelled)
                # Start this iteration's prefill and decode step before taking in the last one's tokens:
                # the device computes while the host delivers, and nothing here waits for the device but
                # that intake, so the host's work per step stays off the critical path.
                prefill = self._admit()
                launched = self._launch()
                self._collect()
                if prefill is not None or launched is not None:
                    self._in_flight = _Iteration(prefill, launched)
                if launched is not None:
                    self._time_step()
                self._flush_events()
        except BaseException as error:  # the loop must report any failure to every waiting caller
            logger.exception("engine loop failed")
            self._error = error
            self._fail_all(error)

    def _emit(self, sequence: _Sequence, event: Event) -> None:
        if self._deliver is None:
            sequence.on_event(event)
        else:
            self._outbox.append((sequence.on_event, event))

    def _flush_events(self) -> None:
        if self._sinks:
            sinks, self._sinks = self._sinks, set()
            for sink in sinks:
                sink.send()  # a sink whose consumer is gone cancels its own sequences
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._deliver(batch)

    def _has_running(self) -> bool:
        return self._in_flight is not None or bool(self._occupant.any())

    def _drop_cancelled(self, cancelled: set[int]) -> None:
        if not cancelled:
            return
        with self._wakeup:
            dropped = [s for s in self._waiting if s.request_id in cancelled]
            self._waiting = deque(s for s in self._waiting if s.request_id not in cancelled)
        # A waiting one ends too, with no tokens: a consumer counting what it sent (a token link's
        # sequences in flight) must see every sequence end.
        for sequence in dropped + [s for s in self._slots if s is not None and s.request_id in cancelled]:
            self._finish(sequence, "abort", [], "")

    def _admit(self) -> tuple[Launch, np.ndarray, np.ndarray] | None:
        """Start the prefill of waiting requests in free slots (lowest first, keeping decode batches small).

        Their first tokens stay on the device, where this iteration's decode step goes on from them;
        the host takes them in with that step's tokens, in the next iteration.
        """
        admitted: list[_Sequence] = []
        budget = self.config.max_prefill_tokens
        with self._wakeup:
            if not self._waiting:
                return None
            free = iter(np.flatnonzero(self._occupant == 0).tolist())
            slot = next(free, None)
            while self._waiting and slot is not None and (not admitted or len(self._waiting[0].prompt) <= budget):
                sequence = self._waiting.popleft()
                sequence.slot = slot
                budget -= len(sequence.prompt)
                self._slots[slot] = sequence
                admitted.append(sequence)
                slot = next(free, None)
        if not admitted:
            return None
        self.drain.record(len(admitted))
        now = time.perf_counter()
        for sequence in admitted:
            s, slot = sequence.params.sampling, sequence.slot
            self.runner.set_sampling(
                slot, s.temperature, s.top_k, s.top_p, s.seed, logprobs=sequence.logprobs is not None
            )
            self._occupant[slot] = sequence.request_id
            self._launched[slot] = 1
            self._budget[slot] = sequence.max_tokens
            self._prompt_len[slot] = len(sequence.prompt)
            self._quiet[slot] = sequence.quiet
            self._taken[slot] = 0
            self._stop_token[slot] = sequence.stop_token
            self._admitted_at[slot] = now
            self.queue_s += now - sequence.submitted_at
            sequence.admitted_at = now
        slots = np.array([s.slot for s in admitted], np.int64)
        # One prompt asking for its log-probabilities makes the whole group's prefill the eager one that
        # computes them (the others' are not kept): echo requests are rare, and one prefill a step is simpler.
        echo = any(s.params.echo and s.logprobs is not None for s in admitted)
        prefill = self.runner.start_prefill([s.prompt for s in admitted], slots.tolist(), echo=echo)
        self.num_prefills += 1
        self.num_prompt_tokens += sum(len(s.prompt) for s in admitted)
        return prefill, slots, self._occupant[slots]

    def _launch(self) -> tuple[Launch, np.ndarray, np.ndarray] | None:
        """Start a decode step for every running sequence that may still need a token."""
        slots = np.flatnonzero((self._occupant != 0) & (self._launched < self._budget))
        if not slots.size:
            return None
        # The token a sequence feeds this step sits at position len(prompt) - 1 + launched.
        max_position = int((self._prompt_len[slots] + self._launched[slots]).max()) - 1
        active = int(slots[-1]) + 1
        self._launched[slots] += 1
        self.num_steps += 1
        self.batch_sizes[slots.size] += 1
        return self.runner.launch(active, slots, max_position), slots, self._occupant[slots]

    def _collect(self) -> None:
        """Take in the first tokens of the last prefill and the tokens of the last decode step; sequences
        that ended meanwhile drop theirs."""
        iteration = self._in_flight
        if iteration is None:
            return
        self._in_flight = None
        # The prefill ran before the step on the device: its tokens (in admission order) come first.
        if iteration.prefill is not None:
            launch, slots, occupants = iteration.prefill
            self._take(slots, occupants, launch.array(), launch.logprobs(), launch.prompt_logprobs)
        if iteration.step is not None:
            launch, slots, occupants = iteration.step
            logprobs = launch.logprobs()  # like the tokens, by slot
            if logprobs is not None:
                logprobs = (logprobs[0][slots], logprobs[1][slots])
            self._take(slots, occupants, launch.array()[slots], logprobs)

    def _take(
        self,
        slots: np.ndarray,
        occupants: np.ndarray,
        tokens: np.ndarray,
        logprobs: tuple[np.ndarray, np.ndarray] | None = None,
        prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Take in one token for each of `slots`, launched while `occupants` held them; a slot whose
        sequence ended (or was cancelled) since then drops its token. `logprobs`: the rows' values and
        top ids (Launch.logprobs), when the launch computed them; `prompt_logprobs`: an echo prefill's."""
        kept = self._occupant[slots] == occupants
        if not kept.all():
            slots, tokens = slots[kept], tokens[kept]
            if logprobs is not None:
                logprobs = (logprobs[0][kept], logprobs[1][kept])
            if prompt_logprobs is not None:
                prompt_logprobs = (prompt_logprobs[0][kept], prompt_logprobs[1][kept])
        quiet = self._quiet[slots]
        if quiet.any():
            self._take_quiet(slots[quiet], tokens[quiet])
        if quiet.all():
            return
        loud = np.flatnonzero(~quiet)
        for row, slot, token in zip(loud.tolist(), slots[loud].tolist(), tokens[loud].tolist(), strict=True):
            sequence = self._slots[slot]
            stream, top = sequence.logprobs, sequence.params.logprobs
            if prompt_logprobs is not None and stream is not None and sequence.params.echo:
                count = len(sequence.prompt) - 1
                scored = logprob_entries(prompt_logprobs[0][row, :count], prompt_logprobs[1][row, :count], top)
                stream.prompt = [None, *scored]
            if sequence.max_tokens == 0:  # scoring only: the prefill's token is not wanted
                self._finish(sequence, "length", [], "")
                continue
            if stream is not None:
                stream.tokens += logprob_entries(logprobs[0][row : row + 1], logprobs[1][row : row + 1], top)
            self._append(sequence, token)

    def _take_quiet(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Quiet sequences' tokens, a step's at once: into the token table, and the finished ones out."""
        taken = self._taken[slots]
        self._table[slots, taken] = tokens
        taken += 1
        self._taken[slots] = taken
        self.num_generated_tokens += slots.size
        first = taken == 1
        if first.any():
            self.first_token_s += float((time.perf_counter() - self._admitted_at[slots[first]]).sum())
            self.num_first_tokens += int(first.sum())
        ended = (taken >= self._budget[slots]) | (tokens == self._stop_token[slots])
        for slot in slots[ended].tolist():
            sequence = self._slots[slot]
            generated = self._table[slot, : self._taken[slot]].tolist()
            sequence.generated = generated
            if generated[-1] == sequence.stop_token:
                self._finish(sequence, "stop", generated[:-1], "")
            else:
                self._finish(sequence, "length", generated, "")

    def _append(self, sequence: _Sequence, token: int) -> None:
        """Record one generated token; emit it (and its text), or finish the sequence."""
        self.num_generated_tokens += 1
        generated = sequence.generated
        generated.append(token)
        if len(generated) == 1:
            self.first_token_s += time.perf_counter() - sequence.admitted_at
            self.num_first_tokens += 1
        last = token == sequence.stop_token or len(generated) >= sequence.max_tokens
        if last:
            reason = "stop" if token == sequence.stop_token else "length"
        sink = sequence.sink
        if sink is not None:  # the hot path of a served sequence: one tuple per token
            if last:
                self._finish(sequence, reason, [token], "")
            else:  # the record built inline unless log-probabilities ride along: this runs for every token
                key = sequence.sink_key
                record = (
                    (key, token, None, None) if sequence.logprobs is None else self._record(sequence, token, None, None)
                )
                sink.pending.append(record)
                self._sinks.add(sink)
            return
        if sequence.output is None:  # tokens only
            if last:
                self._finish(sequence, reason, [token], "")
            else:
                self._emit(sequence, self._event(sequence, [token], ""))
            return
        emitted = sequence.output.add(token, last)
        if emitted is None:
            return
        tokens, text, reason = emitted
        if reason is None:
            self._emit(sequence, self._event(sequence, tokens, text))
        else:  # a stop string may end it before the scheduler would
            self._finish(sequence, reason, tokens, text)

    def _finish(
        self, sequence: _Sequence, reason: str, token_ids: list[int], text: str, error: str | None = None
    ) -> None:
        if 0 <= sequence.slot < len(self._slots) and self._slots[sequence.slot] is sequence:
            self._slots[sequence.slot] = None
            self._occupant[sequence.slot] = 0
        self.num_finished += 1
        if sequence.sink is not None:
            sequence.sink.add(self._record(sequence, token_ids[0] if token_ids else -1, reason, error))
            self._sinks.add(sequence.sink)
            if sequence.on_event is None:
                return
            token_ids = []  # the sink has the tokens; on_event hears only of the end
        event = self._event(sequence, token_ids, text)
        event.finish_reason, event.error = reason, error
        event.prompt_tokens, event.completion_tokens = len(sequence.prompt), len(sequence.generated)
        self._emit(sequence, event)

    @staticmethod
    def _record(sequence: _Sequence, token: int, reason: str | None, error: str | None) -> tuple:
        """A sink's record (TokenRecord): with log-probabilities asked for, the token's and (once) the prompt's."""
        if sequence.logprobs is None:
            return (sequence.sink_key, token, reason, error)
        taken, prompt = sequence.logprobs.take(1 if token >= 0 else 0)
        return (sequence.sink_key, token, reason, error, (taken[0] if taken else None, prompt))

    @staticmethod
    def _event(sequence: _Sequence, token_ids: list[int], text: str) -> Event:
        """An event carrying `token_ids` (the next ones the consumer has not had), with their
        log-probabilities when the request asked for them."""
        event = Event(sequence.request_id, token_ids, text, seed=sequence.params.sampling.seed)
        if sequence.logprobs is not None:
            event.logprobs, event.prompt_logprobs = sequence.logprobs.take(len(token_ids))
        return event

    def _fail_all(self, error: BaseException) -> None:
        with self._wakeup:
            pending = [s for s in self._slots if s is not None] + list(self._waiting)
            self._waiting.clear()
        for sequence in pending:
            try:
                self._finish(sequence, "error", [], "", error=f"engine failed: {error!r}")
            except Exception:  # a consumer's callback must not hide the original failure
                logger.exception("could not deliver the engine failure to request %d", sequence.request_id)
        try:
            self._flush_events()
        except Exception:
            logger.exception("could not deliver the engine failure")


@dataclass(slots=True)
class _Iteration:
    """What one loop iteration started on the device: a prefill of new sequences, a decode step, or both."""

    # Each: the launch, the slots it computes for, and the request ids that held them at the launch.
    prefill: tuple[Launch, np.ndarray, np.ndarray] | None
    step: tuple[Launch, np.ndarray, np.ndarray] | None
