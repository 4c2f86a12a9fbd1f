"""The Parquet file of prompts the batch job reads, built from a text or JSONL file (jobs/make_prompts.py).

Text: one prompt per line, or with split "paragraphs" one prompt per block of lines between blank lines.
JSONL: one object per line; `field` holds the prompt, and the fields the batch job can read per row are
carried over as columns of the same name: `id`, `max_tokens`, `temperature` and `seed` (task score: `id`
and `continuation`). Other fields are left out, with a warning that names them.

The file's columns: `id` (text; '<source file name>:<line>' where the source gives none) and the text column
of the task's recipe, `prompt` (jobs/configs/generate-tiny.yaml) or `text` (score-tiny.yaml), then the
carried columns that any line has. Bad input raises PromptsError naming file:line before anything is written,
and the file is written under a temporary name beside the output, then renamed: a file at the output path is
always whole.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from gpt2_platform.engine.config import MAX_SEED, MAX_TEMPERATURE

logger = logging.getLogger(__name__)

Task = Literal["generate", "score"]
Format = Literal["auto", "text", "jsonl"]
Split = Literal["lines", "paragraphs"]

ID_COLUMN = "id"
TEXT_COLUMN: dict[str, str] = {"generate": "prompt", "score": "text"}
"""The text column per task: the input.prompt_column of the recipe `command` names."""
RECIPE: dict[str, tuple[str, str]] = {
    "generate": ("jobs/configs/generate-tiny.yaml", "runs/generated"),
    "score": ("jobs/configs/score-tiny.yaml", "runs/scored"),
}
"""The recipe and output directory of the command printed next, as the README's batch section writes them."""
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class PromptsError(ValueError):
    """The source cannot be made into a prompts file; the message names file:line and what to do."""


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "text", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _max_tokens(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be an integer >= 1, got {value!r}")
    return value


def _temperature(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"must be a number in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    if not 0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {value!r}")
    return float(value)


def _seed(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"must be an integer in [0, 2**63 - 1], got {value!r}")
    return value


def _continuation(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be non-empty text, got {value!r}")
    return value


@dataclass(frozen=True)
class Carried:
    """A JSONL field the batch job reads per row, written as the column of the same name."""

    name: str
    arrow_type: pa.DataType
    config_key: str
    """The input.* setting that names the column for the batch job."""
    check: Callable[[object], object]
    """The column's value from the field's, or ValueError saying what is wrong with it."""
    every_row: bool = False
    """A row without it would be an error row in the job, so it is all lines or none."""


CARRIED: dict[str, tuple[Carried, ...]] = {
    "generate": (
        Carried("max_tokens", pa.int64(), "input.max_tokens_column", _max_tokens),
        Carried("temperature", pa.float64(), "input.temperature_column", _temperature),
        Carried("seed", pa.int64(), "input.seed_column", _seed),
    ),
    "score": (Carried("continuation", pa.string(), "input.continuation_column", _continuation, every_row=True),),
}


@dataclass
class Row:
    line: int
    text: str
    row_id: str | None = None
    values: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptsFile:
    """A prompts file written, and how the batch job reads it."""

    path: str
    num_rows: int
    task: Task
    overrides: tuple[str, ...]
    """The input.* settings that make the job read the file's id and carried columns."""

    def command(self) -> str:
        """The batch job over this file, with the recipe the README's batch section uses."""
        recipe, output = RECIPE[self.task]
        return (
            f"python jobs/generate.py --config {recipe} --input {shlex.quote(self.path)} --output {output} "
            f"--set {' '.join(self.overrides)}"
        )


def _decode(path: Path) -> list[str]:
    """The file's lines, without their line ends; blank lines at the end of the file are not kept."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise PromptsError(
            f"{path}:{line} is not UTF-8 ({error.reason} at byte offset {error.start}); convert the file to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)"
        ) from error
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def read_text(path: Path, split: Split) -> list[Row]:
    """One row per line, or per block of lines between blank lines; a row's line is its first."""
    lines = _decode(path)
    if split == "lines":
        for number, line in enumerate(lines, 1):
            if not line.strip():
                raise PromptsError(
                    f"{path}:{number} is blank, and every line is a prompt: remove the line, or pass "
                    "--split paragraphs if blank lines separate the prompts"
                )
        return [Row(number, line) for number, line in enumerate(lines, 1)]
    rows: list[Row] = []
    block: list[str] = []
    for number, line in enumerate([*lines, ""], 1):
        if line.strip():
            block.append(line)
        elif block:
            rows.append(Row(number - len(block), "\n".join(block)))
            block = []
    return rows


def _parse(where: str, line: str, text_field: str) -> dict[str, object]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptsError(
            f"{where} is not valid JSON ({error.msg} at column {error.colno}); fix the line or remove it"
        ) from error
    if not isinstance(record, dict):
        raise PromptsError(
            f'{where} is {_json_type(record)}, not an object; write one object a line, e.g. {{"{text_field}": "..."}}'
        )
    return record


def _jsonl_row(where: str, number: int, record: dict[str, object], text_field: str, task: Task) -> Row:
    if text_field not in record:
        raise PromptsError(
            f"{where} has no field {text_field!r} (fields: {', '.join(record) or 'none'}); add it, or pass "
            "--field NAME for the field that holds the prompt"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise PromptsError(f"{where}: field {text_field!r} is {_json_type(text)}, not text")
    if not text.strip():
        raise PromptsError(f"{where}: field {text_field!r} is empty; give the line a prompt or remove it")
    row = Row(number, text)
    row_id = record.get(ID_COLUMN)
    if row_id is not None:
        if isinstance(row_id, bool) or not isinstance(row_id, str | int) or row_id == "":
            raise PromptsError(f"{where}: id must be non-empty text or an integer, got {row_id!r}")
        row.row_id = str(row_id)
    for column in CARRIED[task]:
        value = record.get(column.name)
        if value is not None:
            try:
                row.values[column.name] = column.check(value)
            except ValueError as error:
                raise PromptsError(f"{where}: {column.name} {error}; fix it, or remove the field") from error
    return row


def read_jsonl(path: Path, text_field: str, task: Task) -> list[Row]:
    """One row per object; blank lines are skipped. Fields the job does not read are named in a warning."""
    rows = []
    left_out: set[str] = set()
    known = {text_field, ID_COLUMN, *(column.name for column in CARRIED[task])}
    for number, line in enumerate(_decode(path), 1):
        if line.strip():
            where = f"{path}:{number}"
            record = _parse(where, line, text_field)
            rows.append(_jsonl_row(where, number, record, text_field, task))
            left_out.update(key for key in record if key not in known)
    if left_out:
        logger.warning(
            "%s: left out fields the batch job (task %s) does not read: %s", path, task, ", ".join(sorted(left_out))
        )
    return rows


def _check_rows(path: Path, rows: list[Row], task: Task) -> None:
    """Ids on every row or none, unique; an every-row column on every row or none."""
    if not rows:
        raise PromptsError(f"{path} holds no prompts; write one prompt a line (or JSON object a line)")
    with_id = [row for row in rows if row.row_id is not None]
    if with_id and len(with_id) < len(rows):
        missing = next(row for row in rows if row.row_id is None)
        raise PromptsError(
            f"{path}:{missing.line} has no id, but {path}:{with_id[0].line} has one; give every line an id, or "
            "none (ids are then '<file name>:<line>')"
        )
    seen: dict[str, int] = {}
    for row in with_id:
        assert row.row_id is not None
        if row.row_id in seen:
            raise PromptsError(
                f"{path}:{row.line}: id {row.row_id!r} is already line {seen[row.row_id]}'s; ids must be unique: "
                "renumber or remove one of them"
            )
        seen[row.row_id] = row.line
    for column in CARRIED[task]:
        having = [row for row in rows if column.name in row.values]
        if column.every_row and having and len(having) < len(rows):
            missing = next(row for row in rows if column.name not in row.values)
            raise PromptsError(
                f"{path}:{missing.line} has no {column.name!r}, but {path}:{having[0].line} has one; give every "
                "line one, or none"
            )


def build_table(path: Path, rows: list[Row], task: Task) -> tuple[pa.Table, tuple[str, ...]]:
    """The rows as the batch job's input columns, and the input.* settings that name them."""
    _check_rows(path, rows, task)
    columns = {
        ID_COLUMN: pa.array([row.row_id or f"{path.name}:{row.line}" for row in rows], pa.string()),
        TEXT_COLUMN[task]: pa.array([row.text for row in rows], pa.string()),
    }
    overrides = [f"input.id_column={ID_COLUMN}"]
    for column in CARRIED[task]:
        if any(column.name in row.values for row in rows):
            columns[column.name] = pa.array([row.values.get(column.name) for row in rows], column.arrow_type)
            overrides.append(f"{column.config_key}={column.name}")
    return pa.table(columns), tuple(overrides)


def _check_paths(source: Path, output: Path, overwrite: bool) -> None:
    if not source.is_file():
        raise PromptsError(f"{source} is not a file; give a text or JSONL file of prompts")
    if output.suffix != ".parquet":
        raise PromptsError(f"{output}: name the output *.parquet (a directory input reads only those)")
    if output.exists() and output.resolve() == source.resolve():
        raise PromptsError(f"{output} is the source file; write the prompts to another path")
    if output.is_dir():
        raise PromptsError(f"{output} is a directory; name a file, e.g. {output / 'prompts.parquet'}")
    if output.exists() and not overwrite:
        raise PromptsError(f"{output} exists; pass --overwrite to replace it, or choose another path")


def write_atomically(table: pa.Table, output: Path) -> None:
    """Write under a temporary name beside `output` (hidden, not *.parquet), then rename it into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, temporary, write_page_checksum=True)
        os.replace(temporary, output)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def make_prompts(
    source: str | Path,
    output: str | Path,
    *,
    task: Task = "generate",
    fmt: Format = "auto",
    split: Split | None = None,
    text_field: str | None = None,
    overwrite: bool = False,
) -> PromptsFile:
    """Read `source` (text or JSONL), check every line, and write the prompts file at `output`."""
    source, output_path = Path(source), Path(output)
    if task not in TEXT_COLUMN:
        raise PromptsError(f"task must be generate or score, got {task!r}")
    _check_paths(source, output_path, overwrite)
    if source.suffix == ".parquet":
        raise PromptsError(f"{source} is Parquet already; give it to jobs/generate.py --input as it is")
    if fmt == "auto":
        if source.suffix.lower() == ".json":
            raise PromptsError(f"{source}: a .json file; if it holds one object a line, pass --format jsonl")
        fmt = "jsonl" if source.suffix.lower() in JSONL_SUFFIXES else "text"
    if fmt == "jsonl":
        if split is not None:
            raise PromptsError("--split is for text input; a JSONL file has one prompt a line")
        rows = read_jsonl(source, text_field or TEXT_COLUMN[task], task)
    else:
        if text_field is not None:
            raise PromptsError(f"--field is for JSONL input; {source} is read as text (--format jsonl if it is not)")
        rows = read_text(source, split or "lines")
    table, overrides = build_table(source, rows, task)
    try:
        write_atomically(table, output_path)
    except OSError as error:
        raise PromptsError(f"cannot write {output_path} ({error}); choose a writable path") from error
    return PromptsFile(str(output), table.num_rows, task, overrides)
