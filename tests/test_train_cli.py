"""jobs/train.py: the command line's contract. Bad input -> exit 2, one `error:` line, nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from gpt2_platform import demo_data

TINY_RECIPE = REPO_ROOT / "jobs" / "configs" / "tiny.yaml"


def _load_main() -> Callable[[list[str]], int]:
    # jobs/ is not a package: load the script as a module from its path.
    spec = importlib.util.spec_from_file_location("jobs_train", REPO_ROOT / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


train_main = _load_main()


@pytest.fixture
def storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run's storage path; the working directory is tmp_path, so a stray relative `runs/` lands here too."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


def run_cli(storage: Path, *overrides: str, config: Path = TINY_RECIPE) -> int:
    args = ["--config", str(config), "--set", f"run.storage_path={storage}"]
    for override in overrides:
        args += ["--set", override]
    return train_main(args)


def assert_user_error(code: int, capsys: pytest.CaptureFixture[str], storage: Path, *expected: str) -> str:
    """Exit status 2, exactly one `error:` line naming the problem, and no run directory or checkpoint."""
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2, out
    assert len(errors) == 1, out
    for part in expected:
        assert part in errors[0], errors[0]
    assert not storage.exists(), f"a failed run wrote {sorted(p.name for p in storage.rglob('*'))}"
    return errors[0]


# ---- caught at config load or validation, before Ray starts -------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.block_size=512"], ["data.block_size=512", "context of 256 tokens", "lower data.block_size"]),
        (["model.preset=gpt5"], ["model.preset 'gpt5' is unknown", "tiny", "gpt2-medium"]),
        (["train.max_stepz=3"], ["unknown config key train.max_stepz", "max_steps"]),
        (["foo.bar=1"], ["unknown config key foo", "model", "train"]),
        (
            ["train.global_batch_size=10", "train.micro_batch_size=4", "scaling.num_workers=1"],
            ["train.global_batch_size=10 is not divisible", "train.micro_batch_size", "multiple of 4"],
        ),
        (["train.max_steps=abc"], ["train.max_steps must be an integer", "'abc'"]),
        (["train.max_steps"], ["--set expects key=value", "'train.max_steps'"]),
        (
            ["scaling.strategy=fsdp", "scaling.cpu_offload=true"],
            ["scaling.cpu_offload=true needs GPU workers", "scaling.use_gpu=true"],
        ),
    ],
    ids=[
        "block-size-over-context",
        "unknown-preset",
        "unknown-key",
        "unknown-section",
        "batch-not-divisible",
        "wrong-type",
        "set-without-equals",
        "cpu-offload-without-gpu",
    ],
)
def test_bad_config_exits_2_naming_the_field(capsys, storage: Path, overrides: list[str], expected: list[str]) -> None:
    assert_user_error(run_cli(storage, *overrides), capsys, storage, *expected)


def test_missing_config_file_exits_2_naming_it(capsys, storage: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code = run_cli(storage, config=missing)
    assert_user_error(code, capsys, storage, str(missing), "does not exist", "jobs/configs/")


def test_malformed_yaml_exits_2_naming_the_file_and_line(capsys, storage: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(TINY_RECIPE.read_text().replace("  block_size: 128", " block_size: 128", 1))
    code = run_cli(storage, config=broken)
    assert_user_error(code, capsys, storage, str(broken), "line 7", "is not valid YAML")


def test_random_bytes_as_text_exit_2_naming_file_and_offset(capsys, storage: Path, tmp_path: Path) -> None:
    noise = tmp_path / "noise.txt"
    noise.write_bytes(b"a readable start, then " + bytes(range(128, 256)) * 40)
    code = run_cli(storage, f"data.paths=[{noise}]")
    assert_user_error(code, capsys, storage, str(noise), "is not UTF-8 text", "byte offset 23", "data.paths")


def test_unwritable_storage_path_exits_2_before_ray_starts(capsys, tmp_path: Path, corpus: Path) -> None:
    data = f"data.paths=[{corpus}]"  # the recipe's own data/demo corpus exists only after `make demo`
    # /sys refuses new entries even to root, for whom permission bits (chmod 0o555) do not count.
    code = run_cli(Path("/sys/gpt2-runs"), data)
    assert_user_error(code, capsys, Path("/sys/gpt2-runs"), "run.storage_path=/sys/gpt2-runs is not writable", "/sys")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    code = run_cli(a_file / "runs", data)
    assert_user_error(code, capsys, a_file / "runs", f"{a_file} is a file", "run.storage_path=")


def test_unknown_preset_fails_in_a_fresh_process_without_starting_ray() -> None:
    command = [sys.executable, "jobs/train.py", "--config", "jobs/configs/tiny.yaml", "--set", "model.preset=gpt5"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    elapsed_s = time.monotonic() - started
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "error: model.preset 'gpt5' is unknown; choose one of tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl"
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert elapsed_s < 20, f"a config error took {elapsed_s:.1f} s"


# ---- caught when the data is read (needs Ray) ---------------------------------------------------------


@pytest.mark.slow
def test_missing_data_path_exits_2(ray_cluster, capsys, storage: Path, tmp_path: Path) -> None:
    # BUG (train/data.py, find_files): the message says the path does not exist but not which field to
    # change; it should name data.paths, as the column and format errors name theirs.
    code = run_cli(storage, f"data.paths=[{tmp_path / 'missing.txt'}]")
    assert_user_error(code, capsys, storage, "missing.txt", "does not exist", "data.paths")


@pytest.mark.slow
def test_empty_data_file_exits_2(ray_cluster, capsys, storage: Path, tmp_path: Path) -> None:
    # BUG (train/data.py, find_files): as above, "data files are all empty" names no field to fix.
    empty = tmp_path / "empty.txt"
    empty.touch()
    code = run_cli(storage, f"data.paths=[{empty}]")
    assert_user_error(code, capsys, storage, "empty.txt", "empty", "data.paths")


@pytest.mark.slow
def test_parquet_without_the_text_column_exits_2(ray_cluster, capsys, storage: Path, tmp_path: Path) -> None:
    path = demo_data.write_parquet(tmp_path / "stories.parquet", num_stories=10)
    code = run_cli(storage, f"data.paths=[{path}]", "data.text_column=body")
    assert_user_error(
        code, capsys, storage, "stories.parquet", "no column 'body'", "columns: text, id", "data.text_column"
    )


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_exits_2(ray_cluster, capsys, storage: Path, corpus: Path) -> None:
    code = run_cli(storage, f"data.paths=[{corpus}]", "scaling.num_workers=8")
    assert_user_error(code, capsys, storage, "scaling.num_workers=8 workers", "room for 4 worker(s)")


# The happy path (exit 0, the final metrics and the exported model's directory printed) is tests/test_job_submit.py's:
# the same main() run as a submitted job, one Ray Train run instead of two.
