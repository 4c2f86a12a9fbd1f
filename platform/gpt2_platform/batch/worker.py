"""The Ray Data actors of the batch job: each owns one engine and turns a batch of input rows into output rows
(task generate here, task score in score.py); jobs/evaluate.py's actor (evaluate.py) shares EngineWorker."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from gpt2_platform import gc_pauses
from gpt2_platform.batch.config import GenerationConfig, InputConfig, ProfileConfig
from gpt2_platform.batch.fingerprint import identity_sha256, model_identity
from gpt2_platform.batch.output import write_staged
from gpt2_platform.batch.rows import (
    LOGPROBS_COLUMN,
    Request,
    RowError,
    RowValues,
    blocked_by_moderation,
    build_request,
    derived_id,
    finish_reason,
    output_schema,
    resolve_values,
)
from gpt2_platform.engine.config import EngineConfig
from gpt2_platform.moderation import Moderator

logger = logging.getLogger(__name__)
IMPORTED_AT = time.time()  # when this module (and the engine, torch, transformers below it) finished importing

ACTOR_IMPORTS = (
    "torch",
    "transformers",  # the tokenizer's; gpt2_platform.tokenizer imports it only when loading one
    "gpt2_platform.checkpoint",
    "gpt2_platform.engine.engine",
    "gpt2_platform.tokenizer",
    "gpt2_platform.worker_process",
    __name__,
)
"""What `EngineWorker`'s constructor imports: a job that starts its own Ray has every worker import them ahead
(`init_ray(preload=...)`), so the actors skip seconds of imports. The constructor imports them itself for a
cluster that does not preload, and the driver need not load torch to build a job."""

REPORT_EVERY_S = 15.0
"""How often an actor logs its engine's progress."""

# Ray's synthetic columns, read when the input has no id column.
PATH_COLUMN = "path"
ROW_HASH_COLUMN = "row_hash"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor needs, sent once at construction."""

    model: str
    model_sha256: str  # generate.model_sha256: the model's files by content, in every row
    tokenizer: str | None
    engine: EngineConfig
    device: str
    input: InputConfig
    generation: GenerationConfig
    run_id: str
    staging_dir: str  # where this run's actors write their files (output._staging/<run>)
    moderator: Moderator | None = None  # built on the driver from config.moderation; None: moderation off
    task: str = "generate"  # GenerateConfig.task
    adapter: str | None = None  # a LoRA adapter merged into the model at load (generate.resolve_adapter)
    profile: ProfileConfig | None = None  # GenerateConfig.profile: a trace of the engine's steady state


def _column(batch: pa.Table, name: str | None) -> list:
    return batch.column(name).to_pylist() if name else [None] * batch.num_rows


def batch_ids(batch: pa.Table, id_column: str | None) -> list[str]:
    """The rows' ids: the id column as strings, or '<file name>:<row index>'."""
    if id_column:
        return [str(value) for value in batch.column(id_column).to_pylist()]
    paths = batch.column(PATH_COLUMN).to_pylist()
    hashes = batch.column(ROW_HASH_COLUMN).to_pylist()
    return [derived_id(path, row_hash) for path, row_hash in zip(paths, hashes, strict=True)]


def sampling_modes(generation: GenerationConfig, columns: InputConfig, task: str = "generate") -> tuple[str, ...]:
    """The decode graphs this job can use, so an actor's warm-up captures only those (others: on first use)."""
    if task == "score":  # a scored prompt is one eager prefill: no decode graph is ever used
        return ()
    if columns.temperature_column is None and generation.temperature == 0:
        return ("greedy",)
    return ("greedy", "filtered") if generation.top_k > 0 or generation.top_p < 1.0 else ("greedy", "plain")


def check_model(spec: WorkerSpec) -> None:
    """The model this actor is about to load is the one the driver fingerprinted when the job started.

    Ray Data restarts an actor that died (a node lost hours into a job), and the restarted one loads whatever
    is at the path by then: rows from new weights would be labelled with the old model_sha256. On the
    driver's node the hashes come from the cache; elsewhere the actor hashes the files once. A hub name is
    not checked here (its download is pinned by the hub's revision, not by a path that can change).
    """
    directory = Path(spec.model)
    if not directory.is_dir():
        return
    adapter_dir = None
    if spec.adapter is not None:
        from gpt2_platform.adapter import resolve_adapter_dir

        adapter_dir = resolve_adapter_dir(spec.adapter)
    found = identity_sha256(model_identity(directory, spec.tokenizer, adapter_dir))
    if found != spec.model_sha256:
        raise ValueError(
            f"the model at {directory} is not the one this job started with (model_sha256 {found[:12]}..., "
            f"expected {spec.model_sha256[:12]}...): its files changed during the job; run the job again "
            "(the resume refuses rows of other weights) or restore the model"
        )


class EngineWorker:
    """A Ray Data actor that owns one engine (thread-safe: Ray Data may run several batches on it at once)."""

    def __init__(self, spec: WorkerSpec) -> None:
        constructed_at = time.time()
        preloaded = all(name in sys.modules for name in ACTOR_IMPORTS)
        import torch

        from gpt2_platform.checkpoint import load_pretrained
        from gpt2_platform.engine.engine import Engine
        from gpt2_platform.tokenizer import load_tokenizer
        from gpt2_platform.worker_process import configure_worker_logging, process_age_s

        configure_worker_logging()
        age = process_age_s()
        started = time.perf_counter()
        self.spec = spec
        device = torch.device(spec.device)
        check_model(spec)
        # An adapter is merged into the weights here: the engine reads weights directly and runs a plain model.
        model = load_pretrained(spec.model, device=device, adapter=spec.adapter).eval()
        loaded = time.perf_counter()
        self.tokenizer = load_tokenizer(spec.tokenizer or spec.model)
        self.tokenizer.model_max_length = int(1e12)  # prompts are checked against the context here, not there
        # Ray Data may run several batches at once on this actor's threads (scaling.concurrent_batches_per_actor).
        self.tokenizer_lock = threading.Lock()
        self.engine = Engine(model, self.tokenizer, spec.engine, device=device)
        built = time.perf_counter()
        # Prefill graphs on first use: a job admits groups of prompts, which run packed, in graphs of shapes
        # no warm-up can know (and scoring's are eager); warming the padded ones took a large share of the
        # actor's warm-up, which a small job waits for in full.
        self.engine.start(modes=sampling_modes(spec.generation, spec.input, spec.task), warm_prefills=False)
        self.max_seq_len = self.engine.max_seq_len
        # As the Serve replica and the engine's process do: what is loaded by now lives as long as the actor, so
        # full collections need not walk it; and the progress line says what the collector's pauses cost, as
        # they stop the engine's thread with every other.
        gc_pauses.settle()
        self.gc_pauses = gc_pauses.GcPauses()
        # Start-up is most of a small job's wall time: say where it went, from the process's creation on. Ray
        # starts workers ahead, so the process's age may include time it waited idle before this actor came
        # to it; the driver's "Starting execution" line says when Ray Data asked for the actor.
        if age is not None:
            logger.info(
                "actor process started %.1f s before its constructor ran (imports done at %.1f s, %s; a worker "
                "Ray started ahead counts its idle time too)",
                age,
                age - (constructed_at - IMPORTED_AT),
                "preloaded by the worker" if preloaded else "not preloaded: the cluster does not preload them",
            )
        self._stop_reporting = threading.Event()
        threading.Thread(target=self._report, name="engine-progress", daemon=True).start()
        if spec.profile is not None and spec.profile.trace_dir:
            threading.Thread(target=self._trace, args=(spec.profile,), name="engine-trace", daemon=True).start()
        logger.info(
            "engine ready on %s in %.1f s (model %.1f s, engine %.1f s, warm-up %.1f s)",
            device,
            time.perf_counter() - started,
            loaded - started,
            built - loaded,
            time.perf_counter() - built,
        )

    def _report(self, every_s: float = REPORT_EVERY_S) -> None:
        """A log line every `every_s` while the engine works: what a long job is doing, and, if it is
        slower than the engine can go, whether the engine was starved (idle, rows per step well under
        engine.max_batch_size) or busy."""
        before, then = self.engine.stats() | self.gc_pauses.stats(), time.perf_counter()
        while not self._stop_reporting.wait(every_s):
            now, stats = time.perf_counter(), self.engine.stats() | self.gc_pauses.stats()
            steps, tokens = stats["steps"] - before["steps"], stats["generated_tokens"] - before["generated_tokens"]
            if self.spec.task == "score" and (stats["prefills"] > before["prefills"] or stats["waiting"]):
                # Scoring runs prefills only: their tokens are the work.
                elapsed = now - then
                logger.info(
                    "engine: %.0f tokens/s scored in %.1f prefills/s, %d rows finished, %d waiting, idle %.0f%% "
                    "of the last %.0f s",
                    (stats["prompt_tokens"] - before["prompt_tokens"]) / elapsed,
                    (stats["prefills"] - before["prefills"]) / elapsed,
                    stats["finished"],
                    stats["waiting"],
                    100 * (stats["idle_s"] - before["idle_s"]) / elapsed,
                    elapsed,
                )
            elif steps or stats["waiting"]:
                elapsed = now - then
                captures = stats["captures_on_use"] - before["captures_on_use"]
                collections = [a - b for a, b in zip(stats["gc_count"], before["gc_count"], strict=True)]
                paused = [a - b for a, b in zip(stats["gc_s"], before["gc_s"], strict=True)]
                logger.info(
                    "engine: %.0f tokens/s, %.0f steps/s at %.0f rows a step (of %d slots), %d rows finished, "
                    "%d waiting, idle %.0f%% of the last %.0f s%s; Python's collector paused %.2f s "
                    "(collections by generation %s, %.2f s in generation 2)",
                    tokens / elapsed,
                    steps / elapsed,
                    tokens / max(steps, 1),
                    stats.get("max_batch_size", self.spec.engine.max_slots),
                    stats["finished"],
                    stats["waiting"],
                    100 * (stats["idle_s"] - before["idle_s"]) / elapsed,
                    elapsed,
                    (
                        f"; {captures} graphs captured on first use in "
                        f"{stats['capture_on_use_s'] - before['capture_on_use_s']:.1f} s"
                        if captures
                        else ""
                    ),
                    sum(paused),
                    collections,
                    paused[2],
                )
            before, then = stats, now

    def _trace(self, profile: ProfileConfig) -> None:
        """`profile.seconds` of this process (the engine's thread, Ray Data's, the device) as a Chrome trace in
        `profile.trace_dir`, from `profile.after_s` after the engine was ready; the log line says where. Read
        back by `jobs/trace_summary.py`, not here: parsing tens of MB would hold the GIL the engine needs."""
        from gpt2_platform import traces

        if self._stop_reporting.wait(profile.after_s):
            return  # the job ended first
        assert profile.trace_dir is not None  # the thread starts only with one
        path = Path(profile.trace_dir) / f"engine-{socket.gethostname()}-{os.getpid()}.pt.trace.json"
        try:
            traces.record_window(path, profile.seconds)
        except Exception:  # a trace is there to look at: the job goes on without it
            logger.warning("the engine's trace was not written to %s", path, exc_info=True)
            return
        logger.info(
            "wrote %.1f s of the engine's work as a trace to %s (python jobs/trace_summary.py %s)",
            profile.seconds,
            path,
            path.parent,
        )

    def __del__(self) -> None:
        stop = getattr(self, "_stop_reporting", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        pauses = getattr(self, "gc_pauses", None)
        if pauses is not None:
            pauses.close()


class GenerateBatch(EngineWorker):
    """map_batches callable class of the batch job: input rows (pyarrow) -> output rows (`output_schema`, or
    task score's `score.score_schema`), skipping done ids."""

    def __init__(self, spec: WorkerSpec, done_ids: list) -> None:
        import ray

        super().__init__(spec)
        # done_ids is [ObjectRef] (wrapped, so Ray does not resolve it into every constructor call's args).
        self.done: set[str] = set(ray.get(done_ids[0])) if done_ids else set()
        logger.info("%d ids already done", len(self.done))

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Generate (or score) the batch's rows not yet done and write them as one staged file; returns how many
        it wrote.

        The actor writes (not a Ray Data write stage after it): see run_generation's `_generate` for why.
        """
        from gpt2_platform.batch.score import score_rows

        ids = batch_ids(batch, self.spec.input.id_column)
        keep = [i for i, row_id in enumerate(ids) if row_id not in self.done]
        if len(keep) < batch.num_rows:
            batch, ids = batch.take(pa.array(keep, pa.int64())), [ids[i] for i in keep]
        rows = score_rows(self, batch, ids) if self.spec.task == "score" else self.generate(batch, ids)
        if rows.num_rows:
            write_staged(rows, Path(self.spec.staging_dir))
        return pa.table({"rows_written": [rows.num_rows]})

    def generate(self, batch: pa.Table, ids: list[str]) -> pa.Table:
        """Input rows -> output rows (`output_schema`)."""
        spec, columns = self.spec, self.spec.input
        prompts = _column(batch, columns.prompt_column)
        per_row = zip(
            _column(batch, columns.max_tokens_column),
            _column(batch, columns.temperature_column),
            _column(batch, columns.seed_column),
            strict=True,
        )
        texts = [p if isinstance(p, str) and p else "" for p in prompts]
        with self.tokenizer_lock:  # a fast tokenizer is not safe to call from two threads at once
            tokenized = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        values: list[RowValues] = []
        requests: list[Request | None] = []
        errors: list[str | None] = []
        for row_id, prompt, prompt_ids, (max_tokens, temperature, seed) in zip(
            ids, prompts, tokenized, per_row, strict=True
        ):
            row_values, row_error = resolve_values(row_id, max_tokens, temperature, seed, spec.generation)
            request = None
            if row_error is None:
                try:
                    request = build_request(prompt, prompt_ids, row_values, spec.generation, self.max_seq_len)
                    self.engine.validate(request.prompt_ids, request.params)
                    verdict = spec.moderator.check_prompt(prompt) if spec.moderator is not None else None
                    if verdict is not None:
                        raise blocked_by_moderation(verdict)
                except RowError as refused:
                    row_error, request = refused, None
                except ValueError as invalid:  # what the engine refuses (e.g. a token outside the vocabulary)
                    row_error, request = RowError("invalid_request", str(invalid)), None
            values.append(row_values)
            requests.append(request)
            errors.append(None if row_error is None else str(row_error))

        valid = [r for r in requests if r is not None]
        completions = iter(self.engine.generate([r.prompt_ids for r in valid], [r.params for r in valid]))
        schema = output_schema(spec.generation.logprobs)
        rows: dict[str, list] = {name: [] for name in schema.names}
        for row_id, prompt, row_values, request, error in zip(ids, prompts, values, requests, errors, strict=True):
            completion = next(completions) if request is not None else None
            if completion is not None and completion.error:
                error = f"generation_failed: {completion.error}"
            elif completion is not None and spec.moderator is not None:
                verdict = spec.moderator.check_completion(completion.text)
                error = None if verdict is None else str(blocked_by_moderation(verdict))  # the text is withheld
            shown = completion if error is None else None  # an error row shows no completion
            rows["id"].append(row_id)
            rows["prompt"].append(prompt)
            rows["completion"].append(shown.text if shown is not None else None)
            rows["prompt_tokens"].append(len(request.prompt_ids) if request else None)
            rows["completion_tokens"].append(completion.completion_tokens if completion and not completion.error else 0)
            rows["finish_reason"].append(finish_reason(completion.finish_reason if completion else None, error))
            rows["error"].append(error)
            rows["model"].append(spec.model)
            rows["model_sha256"].append(spec.model_sha256)
            rows["seed"].append(row_values.seed)
            rows["max_tokens"].append(row_values.max_tokens)
            rows["temperature"].append(row_values.temperature)
            rows["truncated_tokens"].append(request.truncated_tokens if request else 0)
            rows["run_id"].append(spec.run_id)
            if spec.generation.logprobs:
                sampled = shown.logprobs if shown is not None else None  # a list wherever the request asked
                rows[LOGPROBS_COLUMN].append([lp for lp, _ in sampled] if sampled is not None else None)
        return pa.table(rows, schema=schema)
