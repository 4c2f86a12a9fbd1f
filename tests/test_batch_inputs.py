"""Batch input checks (gpt2_platform.batch.inputs): a Parquet file whose footer is valid but whose pages are
damaged stops the job before any Ray work, with one line that names the file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import test_batch
from gpt2_platform.batch import load, run_generation
from test_batch import generate_main

model_dir = test_batch.model_dir  # the fixture: the tiny model with the byte tokenizer


def damage_pages(path: Path, row_group: int, column: int = 0) -> None:
    """Overwrite bytes in the middle of one column chunk's pages, leaving the footer as it was."""
    chunk = pq.read_metadata(path).row_group(row_group).column(column)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    middle = start + chunk.total_compressed_size // 2
    data[middle : middle + 32] = b"\xff" * 32
    path.write_bytes(bytes(data))


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    """(a good file, a file with damaged pages in its second row group) in one directory."""
    directory = tmp_path / "prompts"
    directory.mkdir()
    table = pa.table({"prompt": [f"alice has {i} apples" for i in range(300)]})
    good, bad = directory / "a-good.parquet", directory / "b-bad.parquet"
    pq.write_table(table, good, row_group_size=100)
    pq.write_table(table, bad, row_group_size=100)
    damage_pages(bad, row_group=1)
    assert pq.read_metadata(bad).num_rows == 300  # the footer still reads
    with pytest.raises(OSError):
        pq.read_table(bad)
    return good, bad


def config_for(input_dir: Path, output: Path, model: Path, *extra: str):
    return load(
        None,
        [
            f"input.paths=[{input_dir}]",
            f"output.path={output}",
            f"model.path={model}",
            "output.progress_bars=false",
            *extra,
        ],
    )


def test_damaged_pages_are_refused_before_any_work_naming_the_file(inputs, model_dir: Path, tmp_path: Path):
    good, bad = inputs
    output = tmp_path / "out"
    with pytest.raises(ValueError, match=f"input file {bad} is damaged: row group 1 .*cannot be read") as caught:
        run_generation(config_for(good.parent, output, model_dir))
    assert str(good) not in str(caught.value)
    assert not output.exists(), "the output was touched before the input was checked"
    # The same through the id column's path (ids are read in the same pass) and the CLI: one line, exit 2.
    with pytest.raises(ValueError, match="b-bad.parquet is damaged"):
        run_generation(config_for(good.parent, output, model_dir, "input.id_column=prompt"))


def test_cli_exits_2_with_one_line_for_a_damaged_input(
    inputs, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    _, bad = inputs
    code = generate_main(["--input", str(bad), "--output", str(tmp_path / "out"), "--model", str(model_dir)])
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and str(bad) in errors[0] and "Traceback" not in out, out


def test_a_column_the_job_does_not_read_may_be_damaged(tmp_path: Path, model_dir: Path):
    from gpt2_platform.batch.inputs import check_input, find_input_files

    path = tmp_path / "two-columns.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"] * 50, "unused": ["x" * 50] * 100}), path, row_group_size=50)
    damage_pages(path, row_group=0, column=1)
    with pytest.raises(OSError):
        pq.read_table(path, columns=["unused"])
    config = config_for(path, tmp_path / "out", model_dir)
    check_input(find_input_files([str(path)]), config)  # only the prompt column is read


def test_duplicate_ids_are_named(tmp_path: Path, model_dir: Path):
    from gpt2_platform.batch.inputs import check_input, find_input_files

    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "a", "c", "b", "b"], "prompt": ["x"] * 6}), path)
    config = config_for(path, tmp_path / "out", model_dir, "input.id_column=id")
    with pytest.raises(ValueError, match=r"input column 'id' repeats ids: 'a' \(2 rows\), 'b' \(3 rows\); ids must"):
        check_input(find_input_files([str(path)]), config)
