"""Batch generation over Parquet with Ray Data: read_parquet -> map_batches(engine actors) -> write_parquet.

`run_generation(config)` checks the input and the output directory on the driver (seconds, before any Ray
work), commits what an interrupted earlier run left, then generates only the ids not yet in the output and
writes a summary. See `output.py` for why an interruption at any moment loses no row and duplicates none,
and `rows.py` for ids, seeds and error rows.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpt2_platform.batch import output as output_lib
from gpt2_platform.batch.config import GenerateConfig
from gpt2_platform.batch.rows import MODERATION_KINDS
from gpt2_platform.batch.worker import PATH_COLUMN, ROW_HASH_COLUMN, GenerateBatch, WorkerSpec
from gpt2_platform.moderation import Moderator, build_moderator

logger = logging.getLogger(__name__)


class InputError(ValueError):
    """The input cannot be used as configured; the message says why and what to do."""


@dataclass(frozen=True)
class InputFile:
    path: str
    num_rows: int
    size_bytes: int


def find_input_files(paths: list[str]) -> list[InputFile]:
    """Expand files, directories (their *.parquet) and globs into a sorted list, with row counts from footers."""
    if not paths:
        raise InputError("input.paths is empty; set it to Parquet files, directories or globs (--input ...)")
    found: set[Path] = set()
    for spec in paths:
        expanded = os.path.expanduser(spec)
        if glob.has_magic(expanded):
            matches = [Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
        elif Path(expanded).is_dir():
            matches = [
                p for p in Path(expanded).rglob("*.parquet") if p.is_file() and not p.name.startswith((".", "_"))
            ]
        elif Path(expanded).is_file():
            matches = [Path(expanded)]
        else:
            raise InputError(f"input path {spec!r} does not exist; fix input.paths (--input)")
        if not matches:
            raise InputError(f"input path {spec!r} holds no Parquet files; fix input.paths (--input)")
        found.update(p.resolve() for p in matches)
    files = []
    for path in sorted(found):
        try:
            num_rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError) as error:
            raise InputError(f"input file {path} is not a readable Parquet file ({error})") from error
        files.append(InputFile(str(path), num_rows, path.stat().st_size))
    return files


def _numeric(field_type: pa.DataType) -> bool:
    return pa.types.is_integer(field_type) or pa.types.is_floating(field_type) or pa.types.is_null(field_type)


def check_input(files: list[InputFile], config: GenerateConfig) -> None:
    """Every file has the configured columns with usable types, and the row ids are unique."""
    columns = config.input
    roles = {
        columns.prompt_column: "input.prompt_column",
        **{getattr(columns, n): f"input.{n}" for n in ("id_column", "max_tokens_column", "temperature_column")},
        columns.seed_column: "input.seed_column",
    }
    for file in files:
        schema = pq.read_schema(file.path)
        for name in columns.columns():
            if name not in schema.names:
                raise InputError(
                    f"{file.path} has no column {name!r} (columns: {', '.join(schema.names)}); set {roles[name]}"
                )
        prompt_type = schema.field(columns.prompt_column).type
        if not (
            pa.types.is_string(prompt_type) or pa.types.is_large_string(prompt_type) or pa.types.is_null(prompt_type)
        ):
            raise InputError(f"{file.path}: prompt column {columns.prompt_column!r} is {prompt_type}, not text")
        for name in (columns.max_tokens_column, columns.temperature_column, columns.seed_column):
            if name and not _numeric(schema.field(name).type):
                raise InputError(f"{file.path}: column {name!r} is {schema.field(name).type}, not a number")
        if not columns.id_column and {PATH_COLUMN, ROW_HASH_COLUMN} & set(schema.names):
            raise InputError(
                f"{file.path} has a column named {PATH_COLUMN!r} or {ROW_HASH_COLUMN!r}; set input.id_column"
            )
    if columns.id_column:
        ids = pa.chunked_array(
            [pq.read_table(f.path, columns=[columns.id_column]).column(0).cast(pa.string()) for f in files]
        )
        if ids.null_count:
            raise InputError(f"input column {columns.id_column!r} holds {ids.null_count} null ids; every row needs one")
        unique = pc.unique(ids)
        if len(unique) != len(ids):
            raise InputError(
                f"input column {columns.id_column!r} holds {len(ids) - len(unique)} duplicate ids; ids must be unique"
            )
    else:
        names = [os.path.basename(f.path) for f in files]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InputError(
                f"input files share the name {repeated[0]!r}, so the derived ids '<file name>:<row>' would collide; "
                "set input.id_column or rename the files"
            )


def job_identity(
    files: list[InputFile], config: GenerateConfig, model: str, moderator: Moderator | None = None
) -> dict[str, Any]:
    """What the output's rows depend on; resuming into an output made under another identity is refused."""
    generation = asdict(config.generation)
    identity = {
        "input_files": [[os.path.basename(f.path), f.num_rows, f.size_bytes] for f in files],
        "input_columns": asdict(config.input) | {"paths": None},
        "model": model,
        "generation": generation,
        "max_seq_len": config.engine.max_seq_len,
    }
    if moderator is not None:  # only when on, so outputs written before moderation existed still resume
        identity["moderation"] = moderator.identity()
    return identity


def plan_actors(config: GenerateConfig) -> tuple[int, float]:
    """(number of actors, GPUs per actor): one per GPU (or GPU share), one CPU actor without GPUs."""
    import ray

    num_gpus = ray.cluster_resources().get("GPU", 0.0)
    per_actor = config.scaling.num_gpus_per_actor
    if per_actor is None:
        per_actor = 1.0 if num_gpus >= 1 else 0.0
    if per_actor > 0 and num_gpus == 0:
        raise InputError(f"scaling.num_gpus_per_actor is {per_actor} but the cluster has no GPUs; set it to 0")
    num_actors = config.scaling.num_actors
    if num_actors is None:
        num_actors = max(1, int(num_gpus // per_actor)) if per_actor > 0 else 1
    num_cpus = ray.cluster_resources().get("CPU", 0.0)
    # Actors hold their CPUs for the whole run; reading and writing need one more, or the job waits forever.
    if num_actors * config.scaling.num_cpus_per_actor + 1 > num_cpus:
        raise InputError(
            f"{num_actors} actor(s) x scaling.num_cpus_per_actor={config.scaling.num_cpus_per_actor} leave no CPU "
            f"of the cluster's {num_cpus:g} for reading and writing; lower scaling.num_actors or num_cpus_per_actor"
        )
    return num_actors, per_actor


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


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def run_generation(config: GenerateConfig) -> dict[str, Any]:
    """Generate a completion for every input row not yet in the output; return (and save) the summary."""
    from gpt2_platform import checkpoint
    from gpt2_platform.runtime import init_ray

    started = time.perf_counter()
    files = find_input_files(config.input.paths)
    check_input(files, config)
    # Read the blocklist and import the callable now, on the driver: a mistake stops the job before Ray starts.
    moderator = build_moderator(config.moderation)
    model_dir = checkpoint.resolve(config.model.path)
    if not (model_dir / checkpoint.CONFIG_NAME).is_file():
        raise InputError(
            f"model.path {config.model.path} holds no {checkpoint.CONFIG_NAME}; point it at a model directory"
        )
    # A local model by its absolute path: workers (and a job's temporary working dir) may not share our cwd.
    model = str(model_dir.resolve()) if Path(config.model.path).expanduser().is_dir() else config.model.path
    num_input_rows = sum(f.num_rows for f in files)
    directory = Path(config.output.path).expanduser().resolve()
    resumed = output_lib.open_output(directory, job_identity(files, config, model, moderator))
    run_id = new_run_id()
    with exclusive(directory):
        done: set[str] = set()
        if resumed:
            done = output_lib.committed_ids(directory)
            salvaged = output_lib.commit_staged(directory, done)
            logger.info("resuming: %d rows already done (%d from an interrupted run)", len(done), salvaged)
        num_actors, gpus_per_actor = 0, 0.0
        if len(done) < num_input_rows:
            init_ray()
            num_actors, gpus_per_actor = plan_actors(config)
            _generate(config, files, directory, run_id, done, num_actors, gpus_per_actor, model, moderator)
            output_lib.commit_staged(directory, done)
        wall_s = time.perf_counter() - started
        stats = output_lib.output_stats(directory, run_id)
        summary = {
            "run_id": run_id,
            "output": str(directory),
            "input_rows": num_input_rows,
            **stats,
            # Also in errors and errors_by_kind: a blocked row is an error row.
            "moderation_blocked": sum(stats["errors_by_kind"].get(kind, 0) for kind in MODERATION_KINDS),
            "num_actors": num_actors,
            "gpus_per_actor": gpus_per_actor,
            "wall_s": round(wall_s, 3),
            "completion_tokens_per_s": round(stats["completion_tokens_this_run"] / wall_s, 1),
            "total_tokens_per_s": round(
                (stats["prompt_tokens_this_run"] + stats["completion_tokens_this_run"]) / wall_s, 1
            ),
        }
        output_lib.write_json_atomically(directory / output_lib.SUMMARY_NAME, summary)
    if stats["rows"] != num_input_rows or stats["unique_ids"] != stats["rows"]:
        raise RuntimeError(
            f"the output holds {stats['rows']} rows ({stats['unique_ids']} ids) for {num_input_rows} input rows; "
            "run the job again to finish it"
        )
    return summary


def _generate(
    config: GenerateConfig,
    files: list[InputFile],
    directory: Path,
    run_id: str,
    done: set[str],
    num_actors: int,
    gpus_per_actor: float,
    model: str,
    moderator: Moderator | None = None,
) -> None:
    import ray
    import ray.data
    from ray.data import ActorPoolStrategy

    spec = WorkerSpec(
        model=model,
        tokenizer=config.model.tokenizer,
        engine=asdict(config.engine),
        device="cuda" if gpus_per_actor > 0 else "cpu",
        input=config.input,
        generation=config.generation,
        run_id=run_id,
        moderator=moderator,
    )
    derive_ids = not config.input.id_column
    columns = config.input.columns() + ([PATH_COLUMN, ROW_HASH_COLUMN] if derive_ids else [])
    staging = directory / output_lib.STAGING_NAME / run_id
    logger.info(
        "generating %d rows with %d actor(s) into %s", sum(f.num_rows for f in files) - len(done), num_actors, directory
    )
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
        dataset.write_parquet(str(staging))
