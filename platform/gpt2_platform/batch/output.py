"""The output directory of the batch job (generation or scoring): ownership, atomic commits, the ids already done, statistics.

Layout:

    out/_manifest.json          written first (atomically): marks the directory as ours and records
                                which input and settings its rows belong to
    out/part-<run>-<name>.parquet   committed output files: complete, each id in exactly one of them
    out/_staging/<run>/         where the actors of run <run> write, one file per batch
    out/_summary.json           the last run's summary

Each engine actor writes its batch's rows as one file under `_staging/<run>/`, under a temporary name
renamed when complete, so a kill leaves at most a temporary file there. A file is committed by one
`os.replace` into `out/` (atomic on one filesystem) after it has been read back whole (a file cut short
has no footer); rows whose id is already committed are dropped first. So at
any moment `out/part-*` holds complete files and every id at most once, and the committed ids are exactly
the rows that are done.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpt2_platform.batch.rows import OUTPUT_COLUMNS, error_kind

logger = logging.getLogger(__name__)

MANIFEST_NAME = "_manifest.json"
STAGING_NAME = "_staging"
SUMMARY_NAME = "_summary.json"  # "_": pyarrow and pandas skip it when reading the directory
PART_PREFIX = "part-"
FORMAT_VERSION = 1


class OutputError(ValueError):
    """The output path cannot be used for this job; the message says why and what to do."""


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def part_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"{PART_PREFIX}*.parquet") if p.is_file())


def _is_ours(name: str) -> bool:
    return (
        name in (MANIFEST_NAME, STAGING_NAME, SUMMARY_NAME)
        or (name.startswith(PART_PREFIX) and name.endswith(".parquet"))
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def _check_columns(path: Path, columns: Sequence[str]) -> None:
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as error:
        raise OutputError(
            f"{path} is not a readable Parquet file ({error}); the output directory is damaged"
        ) from error
    missing = [c for c in columns if c not in names]
    if missing:
        raise OutputError(
            f"{path} lacks the output columns {', '.join(missing)}: it is not this job's output; "
            "choose another output.path"
        )


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_TASK_ROWS = {"generate": "completions", "score": "log-likelihoods"}


def identity_changes(previous: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """What differs between two job identities, one entry per field ('model_files.model.safetensors: ...')."""
    changes = []
    for key in sorted(set(previous) | set(identity)):
        was, now = previous.get(key), identity.get(key)
        if key == "task":  # recorded for task score only (batch/generate.py): without it, the rows are completions
            was, now = was or "generate", now or "generate"
            if was != now:
                changes.append(f"its rows are of task {was} ({_TASK_ROWS[was]}), this run is task {now}")
            continue
        if was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            for name in sorted(set(was) | set(now)):
                if was.get(name) != now.get(name):
                    state = "missing" if name not in now else "new" if name not in was else "changed"
                    changes.append(f"{key}.{name} {state}: was {_shown(was.get(name))}, now {_shown(now.get(name))}")
        else:
            changes.append(f"{key}: was {_shown(was)}, now {_shown(now)}")
    return changes


def open_output(directory: Path, identity: dict[str, Any], columns: Sequence[str] = OUTPUT_COLUMNS) -> bool:
    """Make `directory` this job's output, or check that it already is; True if it holds earlier work.

    `identity` says which input and settings the rows come from; resuming under a different one would mix
    rows of two jobs, so it is refused. `columns`: those every output file of this job holds.
    """
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"output path {directory} is a file; set output.path to a directory")
    try:
        entries = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    except OSError as error:
        raise OutputError(f"output path {directory} cannot be listed ({error.strerror}); {_CHOOSE_WRITABLE}") from error
    if not entries:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_json_atomically(directory / MANIFEST_NAME, {"format_version": FORMAT_VERSION, "identity": identity})
        except OSError as error:
            raise _unwritable(directory, error) from error
        return False
    foreign = [name for name in entries if not _is_ours(name)]
    if MANIFEST_NAME not in entries or foreign:
        shown = ", ".join((foreign or entries)[:5])
        raise OutputError(
            f"output path {directory} holds files that are not this job's output ({shown}); "
            "choose a new or empty directory"
        )
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise OutputError(f"{directory / MANIFEST_NAME} is unreadable ({error}); choose another output.path") from error
    previous = manifest.get("identity", {}) if isinstance(manifest, dict) else {}
    if previous and "model_files" not in previous:
        raise OutputError(
            f"output path {directory} was written before outputs recorded the hashes of the model's files, so "
            "this run cannot tell whether its rows came from the same weights; choose another output.path"
        )
    changes = identity_changes(previous, identity)
    if changes:
        raise OutputError(
            f"output path {directory} holds the output of a different job ({'; '.join(changes[:4])}); rerun with "
            "the same input, model and settings to resume it, or choose another output.path"
        )
    for path in part_files(directory):
        _check_columns(path, columns)
    check_writable(directory)
    for leftover in directory.glob(".*.tmp"):
        leftover.unlink()
    return True


_CHOOSE_WRITABLE = "choose a directory this job can write to (output.path, --output) or fix its permissions"


def _unwritable(directory: Path, error: OSError) -> OutputError:
    return OutputError(f"output path {directory} is not writable ({error.strerror}); {_CHOOSE_WRITABLE}")


def check_writable(directory: Path) -> None:
    """Create and remove a file in the output and in its staging directory, where the rows and the summary go:
    a read-only output fails here, before any Ray work, not after the rows were generated."""
    try:
        for place in (directory, directory / STAGING_NAME):
            place.mkdir(exist_ok=True)
            probe = place / f".write-check-{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as error:
        raise _unwritable(directory, error) from error


def write_staged(table: pa.Table, run_dir: Path) -> Path:
    """Write one batch's rows as a new file in a run's staging directory: under a temporary name, then
    renamed, so a file with a Parquet name is complete (commit_staged still reads each back)."""
    target = run_dir / f"{uuid.uuid4().hex}.parquet"
    tmp = run_dir / f".{target.name}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, target)
    return target


def read_ids(path: Path) -> list[str]:
    return pq.read_table(path, columns=["id"]).column("id").to_pylist()


def committed_ids(directory: Path) -> set[str]:
    done: set[str] = set()
    for path in part_files(directory):
        done.update(read_ids(path))
    return done


def _readable(path: Path, columns: Sequence[str]) -> pa.Table | None:
    """The file's rows if it is a complete Parquet file with our columns, else None (a write cut short)."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError):
        return None
    return table if all(c in table.column_names for c in columns) else None


def commit_staged(directory: Path, done: set[str], columns: Sequence[str] = OUTPUT_COLUMNS) -> int:
    """Move every complete staged file into `directory`, dropping rows already there; delete partial files.

    Updates `done` and returns the number of rows committed. Idempotent: safe to repeat after a kill.
    `columns`: those a complete file of this job holds.
    """
    staging = directory / STAGING_NAME
    if not staging.is_dir():
        return 0
    num_rows = 0
    for run_dir in sorted(p for p in staging.iterdir() if p.is_dir()):
        for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
            table = _readable(path, columns) if path.suffix == ".parquet" else None
            if table is None:
                logger.info("dropping incomplete staged file %s", path)
                path.unlink()
                continue
            ids = table.column("id").to_pylist()
            fresh = [i for i, row_id in enumerate(ids) if row_id not in done]
            # A row may be unique in the file and also a duplicate of an earlier one in it (never expected).
            first_of: dict[str, int] = {}
            for i in fresh:
                first_of.setdefault(ids[i], i)
            fresh = list(first_of.values())
            target = directory / f"{PART_PREFIX}{run_dir.name}-{path.name}"
            if not fresh:
                path.unlink()
                continue
            if len(fresh) == len(ids):
                os.replace(path, target)
            else:
                tmp = directory / f".{target.name}.tmp"
                pq.write_table(table.take(fresh), tmp)
                os.replace(tmp, target)
                path.unlink()
            done.update(ids[i] for i in fresh)
            num_rows += len(fresh)
        shutil.rmtree(run_dir, ignore_errors=True)
    try:  # a finished output holds only its own files; a run that follows makes the folder again
        staging.rmdir()
    except OSError:
        pass  # not empty: something not ours was put there, and is left for its owner
    return num_rows


def output_stats(directory: Path, run_id: str, task: str = "generate") -> dict[str, Any]:
    """Counts over every committed row, and over the rows of `run_id`; for task score, the totals of the scored
    rows too (their log-likelihood and tokens, and the perplexity over all of them)."""
    counted = "scored_tokens" if task == "score" else "completion_tokens"
    columns = ["id", "prompt_tokens", counted, "error", "run_id", *(["log_likelihood"] if task == "score" else [])]
    files = part_files(directory)
    if files:
        table = pa.concat_tables(pq.read_table(p, columns=columns) for p in files)
    else:
        table = pa.table({c: pa.array([], pa.string()) for c in columns})
    this_run = table.filter(pc.equal(table.column("run_id"), run_id)) if table.num_rows else table

    def tokens(t: pa.Table, column: str) -> int:
        return int(pc.sum(t.column(column)).as_py() or 0) if t.num_rows else 0

    errors = Counter(error_kind(e) for e in table.column("error").to_pylist() if e is not None)
    stats = {
        "rows": table.num_rows,
        "unique_ids": len(set(table.column("id").to_pylist())),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "prompt_tokens": tokens(table, "prompt_tokens"),
        counted: tokens(table, counted),
        "rows_this_run": this_run.num_rows,
        "prompt_tokens_this_run": tokens(this_run, "prompt_tokens"),
        f"{counted}_this_run": tokens(this_run, counted),
    }
    if task == "score":
        scored = stats[counted]
        total = float(pc.sum(table.column("log_likelihood")).as_py() or 0.0) if table.num_rows else 0.0
        stats["log_likelihood"] = total
        stats["perplexity"] = math.exp(min(-total / scored, 700.0)) if scored else None
    return stats
