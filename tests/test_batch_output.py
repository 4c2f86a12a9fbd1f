"""The batch output directory (gpt2_platform.batch.output): an unwritable path and an output written before
model fingerprints are refused with one line, before any Ray work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import test_batch
from gpt2_platform.batch import load, run_generation
from gpt2_platform.batch.output import MANIFEST_NAME
from test_batch import generate_main

model_dir = test_batch.model_dir  # the fixture: the tiny model with the byte tokenizer


@contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """No file can be created in `directory` while inside (read-only permissions; for root, which ignores
    them, the immutable attribute)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)]).returncode != 0:
        pytest.skip("root on a filesystem without the immutable attribute: no way to make a directory unwritable")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["alice has 3 apples", "bob has 2"]}), path)
    return path


def run_cli(prompts: Path, output: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = generate_main(["--input", str(prompts), "--output", str(output), "--model", str(model_dir)])
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out, out
    return code, errors[0]


def test_an_unwritable_output_is_one_line_and_exit_2(
    prompts: Path, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    import ray

    ray_was_up = ray.is_initialized()
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    with unwritable(read_only):
        # A new output under a read-only parent, and the read-only directory itself (empty, so a new output).
        for output in (read_only / "out", read_only):
            code, error = run_cli(prompts, output, model_dir, capsys)
            assert code == 2 and f"output path {output} is not writable" in error, error
    assert ray.is_initialized() == ray_was_up, "Ray was started for a job that could not write its output"


def test_an_output_that_became_unwritable_is_refused_before_resuming(
    prompts: Path, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from gpt2_platform.batch.fingerprint import model_identity
    from gpt2_platform.batch.generate import job_identity
    from gpt2_platform.batch.inputs import find_input_files
    from gpt2_platform.batch.output import open_output

    output = tmp_path / "out"
    config = load(None, [f"input.paths=[{prompts}]", f"output.path={output}", f"model.path={model_dir}"])
    identity = job_identity(find_input_files([str(prompts)]), config, model_identity(model_dir, None))
    assert open_output(output, identity) is False  # made: the manifest of a job that generated nothing yet
    with unwritable(output):
        code, error = run_cli(prompts, output, model_dir, capsys)
    assert code == 2 and f"output path {output} is not writable" in error, error


def test_an_output_from_before_model_fingerprints_is_refused(prompts: Path, model_dir: Path, tmp_path: Path):
    output = tmp_path / "old"
    output.mkdir()
    (output / MANIFEST_NAME).write_text(json.dumps({"format_version": 1, "identity": {"model": str(model_dir)}}))
    config = load(None, [f"input.paths=[{prompts}]", f"output.path={output}", f"model.path={model_dir}"])
    with pytest.raises(ValueError, match="written before outputs recorded the hashes of the model's files"):
        run_generation(config)
