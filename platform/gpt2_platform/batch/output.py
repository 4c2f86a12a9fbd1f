"""The output directory of batch generation: ownership, atomic commits, the ids already done, statistics.

Layout:

    out/_manifest.json          written first (atomically): marks the directory as ours and records
                                which input and settings its rows belong to
    out/part-<run>-<name>.parquet   committed output files: complete, each id in exactly one of them
    out/_staging/<run>/         where Ray's write_parquet of run <run> writes, file by file
    out/_summary.json           the last run's summary

Ray writes each file in place, so a kill can leave a partial file, but only under `_staging/`. A file is
committed by one `os.replace` into `out/` (atomic on one filesystem) after its footer has been read back,
which a partial Parquet file does not have; rows whose id is already committed are dropped first. So at
any moment `out/part-*` holds complete files and every id at most once, and the committed ids are exactly
the rows that are done.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
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


def _check_columns(path: Path) -> None:
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as error:
        raise OutputError(
            f"{path} is not a readable Parquet file ({error}); the output directory is damaged"
        ) from error
    missing = [c for c in OUTPUT_COLUMNS if c not in names]
    if missing:
        raise OutputError(
            f"{path} lacks the output columns {', '.join(missing)}: it is not this job's output; "
            "choose another output.path"
        )


def open_output(directory: Path, identity: dict[str, Any]) -> bool:
    """Make `directory` this job's output, or check that it already is; True if it holds earlier work.

    `identity` says which input and settings the rows come from; resuming under a different one would mix
    rows of two jobs, so it is refused.
    """
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"output path {directory} is a file; set output.path to a directory")
    entries = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not entries:
        directory.mkdir(parents=True, exist_ok=True)
        write_json_atomically(directory / MANIFEST_NAME, {"format_version": FORMAT_VERSION, "identity": identity})
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
    changed = sorted(key for key in set(previous) | set(identity) if previous.get(key) != identity.get(key))
    if changed:
        details = "; ".join(f"{key}: was {previous.get(key)!r}, now {identity.get(key)!r}" for key in changed[:3])
        raise OutputError(
            f"output path {directory} holds the output of a different job ({details}); rerun with the same input "
            "and settings to resume it, or choose another output.path"
        )
    for path in part_files(directory):
        _check_columns(path)
    for leftover in directory.glob(".*.tmp"):
        leftover.unlink()
    return True


def read_ids(path: Path) -> list[str]:
    return pq.read_table(path, columns=["id"]).column("id").to_pylist()


def committed_ids(directory: Path) -> set[str]:
    done: set[str] = set()
    for path in part_files(directory):
        done.update(read_ids(path))
    return done


def _readable(path: Path) -> pa.Table | None:
    """The file's rows if it is a complete Parquet file with our columns, else None (a write cut short)."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError):
        return None
    return table if all(c in table.column_names for c in OUTPUT_COLUMNS) else None


def commit_staged(directory: Path, done: set[str]) -> int:
    """Move every complete staged file into `directory`, dropping rows already there; delete partial files.

    Updates `done` and returns the number of rows committed. Idempotent: safe to repeat after a kill.
    """
    staging = directory / STAGING_NAME
    if not staging.is_dir():
        return 0
    num_rows = 0
    for run_dir in sorted(p for p in staging.iterdir() if p.is_dir()):
        for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
            table = _readable(path) if path.suffix == ".parquet" else None
            if table is None:
                logger.info("dropping incomplete staged file %s", path)
                path.unlink()
                continue
            ids = table.column("id").to_pylist()
            fresh = [i for i, row_id in enumerate(ids) if row_id not in done]
            # A row may be unique in the file and also a duplicate of an earlier one in it (never expected).
            seen: set[str] = set()
            fresh = [i for i in fresh if not (ids[i] in seen or seen.add(ids[i]))]
            target = directory / f"{PART_PREFIX}{run_dir.name}-{path.name}"
            if not fresh:
                path.unlink()
                continue
            if len(fresh) == len(ids):
                os.replace(path, target)
            else:
                tmp = directory / f".{target.name}.tmp"
                pq.write_table(table.take(fresh).select(list(OUTPUT_COLUMNS)), tmp)
                os.replace(tmp, target)
                path.unlink()
            done.update(ids[i] for i in fresh)
            num_rows += len(fresh)
        shutil.rmtree(run_dir, ignore_errors=True)
    return num_rows


def output_stats(directory: Path, run_id: str) -> dict[str, Any]:
    """Counts over every committed row, and over the rows of `run_id`."""
    columns = ["id", "prompt_tokens", "completion_tokens", "error", "run_id"]
    files = part_files(directory)
    if files:
        table = pa.concat_tables(pq.read_table(p, columns=columns) for p in files)
    else:
        table = pa.table({c: pa.array([], pa.string()) for c in columns})
    this_run = table.filter(pc.equal(table.column("run_id"), run_id)) if table.num_rows else table

    def tokens(t: pa.Table, column: str) -> int:
        return int(pc.sum(t.column(column)).as_py() or 0) if t.num_rows else 0

    errors = Counter(error_kind(e) for e in table.column("error").to_pylist() if e is not None)
    return {
        "rows": table.num_rows,
        "unique_ids": len(set(table.column("id").to_pylist())),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "prompt_tokens": tokens(table, "prompt_tokens"),
        "completion_tokens": tokens(table, "completion_tokens"),
        "rows_this_run": this_run.num_rows,
        "prompt_tokens_this_run": tokens(this_run, "prompt_tokens"),
        "completion_tokens_this_run": tokens(this_run, "completion_tokens"),
    }
