"""The batch job over Parquet with Ray Data: read_parquet -> map_batches(engine actors, which write the rows).

Task generate writes a completion per row; task score the log-likelihood of each row's text (score.py).
`run_generation(config)` checks the input and the output directory on the driver (seconds, before any Ray
work), commits what an interrupted earlier run left, then generates only the ids not yet in the output and
writes a summary. See `output.py` for why an interruption at any moment loses no row and duplicates none,
and `rows.py` for ids, seeds and error rows.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from gpt2_platform.batch import fingerprint
from gpt2_platform.batch import output as output_lib
from gpt2_platform.batch.config import GenerateConfig, ModelConfig, ScalingConfig
from gpt2_platform.batch.inputs import InputError, InputFile, check_input, find_input_files
from gpt2_platform.batch.rows import MODERATION_KINDS, output_schema
from gpt2_platform.batch.score import score_schema
from gpt2_platform.batch.worker import ACTOR_IMPORTS, PATH_COLUMN, ROW_HASH_COLUMN, GenerateBatch, WorkerSpec
from gpt2_platform.moderation import Moderator, build_moderator

logger = logging.getLogger(__name__)


def job_identity(
    files: list[InputFile], config: GenerateConfig, model: dict[str, Any], moderator: Moderator | None = None
) -> dict[str, Any]:
    """What the output's rows depend on; resuming into an output made under another identity is refused.

    `model` is `fingerprint.model_identity(...)`: the weights themselves, so new weights at the same path are
    refused and the same weights moved to another path still resume.
    """
    identity = {
        "input_files": [[os.path.basename(f.path), f.num_rows, f.size_bytes] for f in files],
        "input_columns": asdict(config.input) | {"paths": None},
        **model,
        "max_seq_len": config.engine.max_seq_len,
    }
    if config.task == "score":  # recorded only then, so outputs generated before scoring existed still resume
        identity["task"] = config.task
    else:  # scoring reads none of the generation settings: changing them does not make it another job
        identity["generation"] = asdict(config.generation)
    if moderator is not None:  # only when on, so outputs written before moderation existed still resume
        identity["moderation"] = moderator.identity()
    return identity


def output_directory(path: str) -> Path:
    """Where the output goes. A relative path is taken from the current directory, except under `ray job
    submit`, whose working directory is a temporary copy deleted with the job: there it goes under
    ~/gpt2-platform/, as training's run.storage_path does (use an absolute path on shared storage for a
    multi-node cluster: the actors write where the driver points them)."""
    directory = Path(path).expanduser()
    if not directory.is_absolute() and _in_submitted_job():
        directory = Path.home() / "gpt2-platform" / directory
        logger.warning("output.path %s is relative inside a submitted job; writing to %s", path, directory)
    return directory.resolve()


def _in_submitted_job() -> bool:
    # The job supervisor hands the job's runtime env to its driver in this variable (train/trainer.py reads it too).
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def output_columns(config: GenerateConfig) -> list[str]:
    """The columns of the job's output files."""
    if config.task == "score":
        return score_schema(config.input.continuation_column is not None).names
    return output_schema(config.generation.logprobs).names


def plan_actors(scaling: ScalingConfig) -> tuple[int, float]:
    """(number of actors, GPUs per actor): one per GPU (or GPU share), one CPU actor without GPUs."""
    import ray

    num_gpus = ray.cluster_resources().get("GPU", 0.0)
    per_actor = scaling.num_gpus_per_actor
    if per_actor is None:
        per_actor = 1.0 if num_gpus >= 1 else 0.0
    if per_actor > 0 and num_gpus == 0:
        raise InputError(f"scaling.num_gpus_per_actor is {per_actor} but the cluster has no GPUs; set it to 0")
    num_actors = scaling.num_actors
    if num_actors is None:
        num_actors = max(1, int(num_gpus // per_actor)) if per_actor > 0 else 1
    num_cpus = ray.cluster_resources().get("CPU", 0.0)
    # Actors hold their CPUs for the whole run (and write their own rows); reading needs one more, or the job
    # waits forever.
    if job_needs(num_actors, per_actor, scaling)["CPU"] > num_cpus:
        raise InputError(
            f"{num_actors} actor(s) x scaling.num_cpus_per_actor={scaling.num_cpus_per_actor} leave no CPU "
            f"of the cluster's {num_cpus:g} for reading the input; lower scaling.num_actors or num_cpus_per_actor"
        )
    return num_actors, per_actor


def connect_and_plan_actors(scaling: ScalingConfig) -> tuple[int, float]:
    """Connect to (or start) Ray, plan the actors and wait for their resources: (actors, GPUs per actor)."""
    from gpt2_platform.runtime import init_ray

    init_ray(preload=ACTOR_IMPORTS)
    num_actors, gpus_per_actor = plan_actors(scaling)
    wait_for_resources(num_actors, gpus_per_actor, scaling)
    return num_actors, gpus_per_actor


def job_needs(num_actors: int, gpus_per_actor: float, scaling: ScalingConfig) -> dict[str, float]:
    """The CPUs and GPUs the job holds while it runs: its actors', and one CPU more to read the input with."""
    return {"CPU": num_actors * scaling.num_cpus_per_actor + 1, "GPU": num_actors * gpus_per_actor}


@contextmanager
def capacity_watch(needed: dict[str, float], period_s: float = 5.0) -> Iterator[None]:
    """While the job runs, say when the cluster's totals fall below what it needs, and when they are back.

    A node lost mid-job takes its actors' and read tasks' resources with it; Ray restarts them on the nodes
    left, and where those cannot hold them all it waits for a node to join, printing nothing
    (docs/operating.md, "When a node dies"). Without this line the job would look hung.
    """
    import ray

    stop = threading.Event()

    def watch() -> None:
        short_before = False
        while not stop.wait(period_s):
            try:
                totals = ray.cluster_resources()
            except Exception:  # Ray is going away with the job: nothing left to watch
                return
            short = {name: amount for name, amount in needed.items() if amount > 0 and totals.get(name, 0.0) < amount}
            if short and not short_before:
                shown = ", ".join(
                    f"{amount:g} {name} (the cluster has {totals.get(name, 0.0):g})" for name, amount in short.items()
                )
                logger.warning(
                    "the cluster no longer holds what this job needs, %s: a node was lost. The job waits, without "
                    "an error, until a node joins; or stop it and resubmit with the same output, whose committed "
                    "rows are kept",
                    shown,
                )
            elif short_before and not short:
                logger.info("the cluster holds what this job needs again; it goes on")
            short_before = bool(short)

    thread = threading.Thread(target=watch, name="gpt2-batch-capacity", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=period_s + 1)


def wait_for_resources(num_actors: int, gpus_per_actor: float, scaling: ScalingConfig) -> None:
    """Wait until the cluster has the job's CPUs and GPUs free (actors, plus one CPU to read with), at most
    scaling.wait_for_resources_s; then refuse, saying what is missing, instead of a job that waits forever.

    plan_actors checked the cluster's totals; this checks what is free now, e.g. while the actors of a job
    that just ended (a killed run being resumed, a Serve app shut down) release theirs.
    """
    import ray

    needed = job_needs(num_actors, gpus_per_actor, scaling)
    deadline = time.monotonic() + scaling.wait_for_resources_s
    said = False
    while True:
        free = ray.available_resources()
        short = {name: amount for name, amount in needed.items() if amount > 0 and free.get(name, 0.0) < amount}
        if not short:
            return
        shown = ", ".join(f"{amount:g} {name} (free: {free.get(name, 0.0):g})" for name, amount in short.items())
        if time.monotonic() >= deadline:
            raise InputError(
                f"the cluster does not have the resources this job needs free: {shown}, after waiting "
                f"{scaling.wait_for_resources_s:g} s (scaling.wait_for_resources_s); stop what holds them "
                "(`ray status` shows usage) or lower scaling.num_actors"
            )
        if not said:
            logger.info("waiting up to %.0f s for %s", scaling.wait_for_resources_s, shown)
            said = True
        time.sleep(0.5)


@contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold a lock on the output for the run: a second job on it would delete the first one's staged files."""
    with open(directory / output_lib.MANIFEST_NAME) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise output_lib.OutputError(
                f"another job is writing to {directory}; wait for it or choose another path"
            ) from error
        yield


@contextmanager
def data_context(progress_bars: bool) -> Iterator[None]:
    """Settings for the Datasets created inside (a Dataset copies the DataContext when it is created)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.enable_progress_bars
    context.enable_progress_bars = progress_bars
    try:
        yield
    finally:
        context.enable_progress_bars = before


def resolve_adapter(adapter: str | None, model_dir: Path, model: str) -> tuple[str | None, Path | None]:
    """`model.adapter` checked against the model on the driver, before Ray starts: (what the actors load, a local
    adapter by its absolute path; the directory to fingerprint), or (None, None) without an adapter. A missing
    adapter, one we cannot merge, or one trained on a base of another shape is refused in one line."""
    if adapter is None:
        return None, None
    from gpt2_platform import checkpoint
    from gpt2_platform.adapter import check_adapter, read_adapter

    loaded = read_adapter(adapter)
    check_adapter(loaded, checkpoint.read_config(model_dir), model)
    directory = Path(loaded.source).resolve()
    return (str(directory) if Path(adapter).expanduser().is_dir() else adapter), directory


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def run_generation(config: GenerateConfig) -> dict[str, Any]:
    """Generate a completion for (task score: score) every input row not yet in the output; return (and save)
    the summary."""
    started = time.perf_counter()
    files = find_input_files(config.input.paths)
    check_input(files, config)
    # Read the blocklist and import the callable now, on the driver: a mistake stops the job before Ray starts.
    moderator = build_moderator(config.moderation)
    model_dir, model, tokenizer = _resolve_model(config.model)
    adapter, adapter_dir = resolve_adapter(config.model.adapter, model_dir, model)
    num_input_rows = sum(f.num_rows for f in files)
    directory = output_directory(config.output.path)
    model_id = fingerprint.model_identity(model_dir, tokenizer, adapter_dir)
    model_sha256 = fingerprint.identity_sha256(model_id)
    columns = output_columns(config)
    resumed = output_lib.open_output(directory, job_identity(files, config, model_id, moderator), columns)
    run_id = new_run_id()
    with exclusive(directory):
        done = _resume(directory, columns) if resumed else set()
        num_actors, gpus_per_actor = 0, 0.0
        if len(done) < num_input_rows:
            num_actors, gpus_per_actor = connect_and_plan_actors(config.scaling)
            spec = _worker_spec(
                config, model, model_sha256, tokenizer, adapter, moderator, run_id, directory, gpus_per_actor
            )
            verb = "scoring" if config.task == "score" else "generating"
            logger.info("%s %d rows with %d actor(s) into %s", verb, num_input_rows - len(done), num_actors, directory)
            _generate(config, files, spec, done, num_actors, gpus_per_actor)
            output_lib.commit_staged(directory, done, columns)
        wall_s = time.perf_counter() - started
        stats = output_lib.output_stats(directory, run_id, config.task)
        summary = {
            "task": config.task,
            "run_id": run_id,
            "output": str(directory),
            "model": model,
            **({"adapter": adapter} if adapter is not None else {}),
            "model_sha256": model_sha256,
            "input_rows": num_input_rows,
            **stats,
            "num_actors": num_actors,
            "gpus_per_actor": gpus_per_actor,
            "wall_s": round(wall_s, 3),
            **_rates(config.task, stats, wall_s),
        }
        output_lib.write_json_atomically(directory / output_lib.SUMMARY_NAME, summary)
    if stats["rows"] != num_input_rows or stats["unique_ids"] != stats["rows"]:
        raise RuntimeError(
            f"the output holds {stats['rows']} rows ({stats['unique_ids']} ids) for {num_input_rows} input rows; "
            "run the job again to finish it"
        )
    return summary


def _resolve_model(model_config: ModelConfig) -> tuple[Path, str, str | None]:
    """(the model's directory, the model and the tokenizer as the actors load them), checked on the driver."""
    from gpt2_platform import checkpoint

    model_dir = checkpoint.resolve(model_config.path)
    if not (model_dir / checkpoint.CONFIG_NAME).is_file():
        raise InputError(
            f"model.path {model_config.path} holds no {checkpoint.CONFIG_NAME}; point it at a model directory"
        )
    checkpoint.read_config(model_dir)  # a variant the model does not implement stops the job before Ray starts
    # A local model (and tokenizer) by its absolute path: workers (and a job's temporary working dir) may not
    # share our cwd.
    model = str(model_dir.resolve()) if Path(model_config.path).expanduser().is_dir() else model_config.path
    tokenizer = model_config.tokenizer
    if tokenizer is not None and Path(tokenizer).expanduser().is_dir():
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    return model_dir, model, tokenizer


def _worker_spec(
    config: GenerateConfig,
    model: str,
    model_sha256: str,
    tokenizer: str | None,
    adapter: str | None,
    moderator: Moderator | None,
    run_id: str,
    directory: Path,
    gpus_per_actor: float,
) -> WorkerSpec:
    """What each actor is sent: the model, the job's settings and where this run stages its rows."""
    return WorkerSpec(
        model=model,
        model_sha256=model_sha256,
        tokenizer=tokenizer,
        engine=config.engine,
        device="cuda" if gpus_per_actor > 0 else "cpu",
        input=config.input,
        generation=config.generation,
        run_id=run_id,
        staging_dir=str(directory / output_lib.STAGING_NAME / run_id),
        moderator=moderator,
        task=config.task,
        profile=config.profile,
        adapter=adapter,
    )


def _resume(directory: Path, columns: list[str]) -> set[str]:
    """The ids already in the output, with the rows an interrupted run left staged committed first."""
    done = output_lib.committed_ids(directory)
    salvaged = output_lib.commit_staged(directory, done, columns)
    logger.info("resuming: %d rows already done (%d from an interrupted run)", len(done), salvaged)
    return done


def _rates(task: str, stats: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The summary's tokens per second for the task (and, for generate, the rows moderation blocked)."""
    if task == "score":
        return {"prompt_tokens_per_s": round(stats["prompt_tokens_this_run"] / wall_s, 1)}
    return {
        # Also in errors and errors_by_kind: a blocked row is an error row.
        "moderation_blocked": sum(stats["errors_by_kind"].get(kind, 0) for kind in MODERATION_KINDS),
        "completion_tokens_per_s": round(stats["completion_tokens_this_run"] / wall_s, 1),
        "total_tokens_per_s": round(
            (stats["prompt_tokens_this_run"] + stats["completion_tokens_this_run"]) / wall_s, 1
        ),
    }


def _generate(
    config: GenerateConfig,
    files: list[InputFile],
    spec: WorkerSpec,
    done: set[str],
    num_actors: int,
    gpus_per_actor: float,
) -> None:
    import ray
    import ray.data
    from ray.data import ActorPoolStrategy

    Path(spec.staging_dir).mkdir(parents=True, exist_ok=True)
    derive_ids = not config.input.id_column
    columns = config.input.columns() + ([PATH_COLUMN, ROW_HASH_COLUMN] if derive_ids else [])
    with data_context(config.output.progress_bars):
        dataset = ray.data.read_parquet(
            [f.path for f in files], include_paths=derive_ids, include_row_hash=derive_ids
        ).select_columns(columns)
        # Blocks of batch_size rows: every actor gets work even from one big file, and each block becomes its
        # own output file as soon as it is generated (the unit an interrupted run keeps).
        dataset = dataset.repartition(target_num_rows_per_block=config.scaling.batch_size)
        dataset = dataset.map_batches(
            GenerateBatch,
            fn_constructor_kwargs={"spec": spec, "done_ids": [ray.put(sorted(done))]},
            # Several calls at once per actor, on threads: they share the actor's engine, which is thread-safe.
            compute=ActorPoolStrategy(
                size=num_actors,
                max_concurrent_calls_per_actor=config.scaling.concurrent_batches_per_actor,
                enable_true_multi_threading=True,
            ),
            batch_size=config.scaling.batch_size,
            batch_format="pyarrow",
            num_cpus=config.scaling.num_cpus_per_actor,
            num_gpus=gpus_per_actor,
        )
        # The actors write their rows themselves and return only counts, which are streamed here. Why not
        # write_parquet: it runs through materialize(), which checks for any free CPU before the run and
        # again after it, on the finished blocks. CPUs held at either moment (by the actors of a job that is
        # going away, or by this job's own actors as they shut down) made Ray print "The Dataset job will
        # hang unless more CPUs are freed up" on runs that then succeeded. Streaming runs neither check;
        # wait_for_resources checks what this job needs, before it starts, and says what is missing.
        with capacity_watch(job_needs(num_actors, gpus_per_actor, config.scaling)):
            written = sum(
                pc.sum(batch.column("rows_written")).as_py() or 0
                for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow")
            )
    logger.info("wrote %d rows", written)
