"""The input of batch generation: Parquet files found from paths and globs, checked before any Ray work.

Checked up front: each file's footer, the configured columns and their types, that every page of those
columns decodes (a file with a valid footer but damaged pages would otherwise fail the job halfway, in a
Ray task's traceback), and that the row ids are unique.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpt2_platform.batch.config import GenerateConfig
from gpt2_platform.batch.worker import PATH_COLUMN, ROW_HASH_COLUMN

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


def read_columns(file: InputFile, columns: list[str], id_column: str | None) -> list[pa.Array]:
    """Decode every page of the job's columns in `file` (one batch in memory at a time); its ids, as text.

    Reading them all costs a small fraction of generating from them, and it turns a damaged file into one
    error that names it before the job starts, instead of a failed Ray task once half the rows are done.
    Page checksums are verified where the writer stored them.
    """
    ids: list[pa.Array] = []
    num_rows = 0
    group = 0
    try:
        parquet = pq.ParquetFile(file.path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as error:
        raise InputError(f"input file {file.path} is not a readable Parquet file ({error})") from error
    try:
        for group in range(parquet.num_row_groups):
            for batch in parquet.iter_batches(batch_size=65536, row_groups=[group], columns=columns):
                if id_column:
                    ids.append(batch.column(id_column).cast(pa.string()))
            num_rows += parquet.metadata.row_group(group).num_rows
    except (pa.ArrowException, OSError) as error:
        raise InputError(
            f"input file {file.path} is damaged: row group {group} (of {parquet.num_row_groups}, from row {num_rows}) "
            f"cannot be read ({type(error).__name__}: {error}); restore or rewrite the file, or leave it out of "
            "input.paths"
        ) from error
    return ids


def check_input(files: list[InputFile], config: GenerateConfig) -> None:
    """Every file has the configured columns with usable types, every page of them reads, and the row ids are
    unique."""
    columns = config.input
    roles = {
        columns.prompt_column: "input.prompt_column",
        **{getattr(columns, n): f"input.{n}" for n in ("id_column", "max_tokens_column", "temperature_column")},
        columns.seed_column: "input.seed_column",
        columns.continuation_column: "input.continuation_column",
    }
    for file in files:
        schema = pq.read_schema(file.path)
        for column_name in columns.columns():
            if column_name not in schema.names:
                raise InputError(
                    f"{file.path} has no column {column_name!r} (columns: {', '.join(schema.names)}); "
                    f"set {roles[column_name]}"
                )
        for name in (columns.prompt_column, columns.continuation_column):
            text_type = schema.field(name).type if name else pa.string()
            if not (
                pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_null(text_type)
            ):
                raise InputError(f"{file.path}: column {name!r} ({roles[name]}) is {text_type}, not text")
        for name in (columns.max_tokens_column, columns.temperature_column, columns.seed_column):
            if name and not _numeric(schema.field(name).type):
                raise InputError(f"{file.path}: column {name!r} is {schema.field(name).type}, not a number")
        if not columns.id_column and {PATH_COLUMN, ROW_HASH_COLUMN} & set(schema.names):
            raise InputError(
                f"{file.path} has a column named {PATH_COLUMN!r} or {ROW_HASH_COLUMN!r}; set input.id_column"
            )
    started = time.perf_counter()
    chunks = [chunk for file in files for chunk in read_columns(file, columns.columns(), columns.id_column)]
    if time.perf_counter() - started > 1.0:
        logger.info("checked every page of the input in %.1f s", time.perf_counter() - started)
    if columns.id_column:
        ids = pa.chunked_array(chunks, pa.string())
        if ids.null_count:
            raise InputError(f"input column {columns.id_column!r} holds {ids.null_count} null ids; every row needs one")
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))
        if len(repeated):
            shown = ", ".join(
                f"{value!r} ({count} rows)"
                for value, count in zip(
                    repeated.field(0)[:5].to_pylist(), repeated.field(1)[:5].to_pylist(), strict=True
                )
            )
            more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
            raise InputError(
                f"input column {columns.id_column!r} repeats ids: {shown}{more}; ids must be unique: remove or "
                "renumber the repeated rows, or unset input.id_column to derive ids from file and row"
            )
    else:
        names = [os.path.basename(f.path) for f in files]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InputError(
                f"input files share the name {repeated[0]!r}, so the derived ids '<file name>:<row>' would collide; "
                "set input.id_column or rename the files"
            )
