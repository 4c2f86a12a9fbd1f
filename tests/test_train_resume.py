"""Resuming a run: broken checkpoints are passed over for the newest whole one, the LR schedule stays
continuous when train.max_steps grows, and a max_steps below the run's step is refused."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_RUN_NAME, TINY_RUN_OVERRIDES, tiny_config
from gpt2_platform.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.train.loop import HISTORY
from gpt2_platform.train.resume import (
    OPTIMIZER_STATE,
    TRAIN_STATE,
    CheckpointError,
    checkpoint_problem,
    choose_checkpoint,
)
from gpt2_platform.train.trainer import fit

pytestmark = pytest.mark.slow

# The run of conftest.tiny_run: a report every step, checkpoints every 2 steps (4 kept), validation at steps 4
# and 8, named "resume". Every run here resumes it under the same settings but train.max_steps.
RUN_NAME = TINY_RUN_NAME
OVERRIDES = TINY_RUN_OVERRIDES


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint_step_{step:08d}"


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / HISTORY).read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tiny_run) -> Path:
    """An 8-step run with checkpoints at steps 2, 4, 6 and 8; tests copy it before they damage it (the session's
    run, conftest.py: tests/test_evaluate.py evaluates it as it is)."""
    assert tiny_run.run_dir.name == RUN_NAME
    return tiny_run.run_dir


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    # Ray's run snapshot names checkpoints relative to the run directory, so a copy resumes as itself.
    return Path(shutil.copytree(trained, tmp_path / "runs" / RUN_NAME))


def truncate(path: Path, keep_bytes: int = 1000) -> None:
    path.write_bytes(path.read_bytes()[:keep_bytes])


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: truncate(d / WEIGHTS_NAME), f"{WEIGHTS_NAME} is unreadable"),
        (lambda d: [p.unlink() for p in d.iterdir()], "is empty"),
        (lambda d: (d / TRAIN_STATE).write_text('{"step": 8, "tok'), f"{TRAIN_STATE} is not valid JSON"),
        (lambda d: (d / CONFIG_NAME).write_text("{"), f"{CONFIG_NAME} is not valid JSON"),
        (lambda d: truncate(d / OPTIMIZER_STATE, 5000), f"{OPTIMIZER_STATE} is truncated or not a torch file"),
        (lambda d: (d / OPTIMIZER_STATE).unlink(), f"has no {OPTIMIZER_STATE}"),
        (lambda d: (d / "config.yaml").write_text("train: [1,\n"), "config.yaml is not valid YAML"),
    ],
    ids=["truncated-weights", "empty-directory", "broken-state-json", "broken-config-json", "truncated-optimizer",
         "missing-optimizer", "broken-config-yaml"],
)  # fmt: skip
def test_each_kind_of_damage_is_found_and_named(trained: Path, tmp_path: Path, damage, expected: str) -> None:
    checkpoint = Path(shutil.copytree(step_dir(trained, 8), tmp_path / "checkpoint_step_00000008"))
    assert checkpoint_problem(checkpoint) is None
    damage(checkpoint)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and expected in problem, problem


def test_a_broken_latest_checkpoint_falls_back_and_extending_max_steps_keeps_the_schedule(
    run_copy: Path, trained: Path, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    truncate(step_dir(run_copy, 8) / WEIGHTS_NAME)
    for path in step_dir(run_copy, 6).iterdir():
        path.unlink()
    caplog.set_level(logging.INFO, logger="gpt2_platform")
    result = fit(tiny_config(corpus, run_copy.parent, *OVERRIDES, "train.max_steps=10"))

    # The driver said which checkpoint it resumes from and why the newer ones were passed over.
    (warning,) = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert "resuming from checkpoint_step_00000004 (step 4)" in warning
    assert f"checkpoint_step_00000008 {WEIGHTS_NAME} is unreadable" in warning
    assert "checkpoint_step_00000006 is empty" in warning
    records = history(run_copy)
    starts = [r["start_step"] for r in records if r.get("event") == "start"]
    assert starts == [0, 4], "one attempt, from step 4: no failed retries on the broken checkpoint"

    # From step 4 the run repeats the first run's steps exactly: same learning rates, same losses.
    first = {r["step"]: r for r in history(trained) if "loss" in r}
    resumed = {r["step"]: r for r in records[[r.get("event") for r in records].index("start", 1) :] if "loss" in r}
    assert sorted(resumed) == [5, 6, 7, 8, 9, 10]
    for step in (5, 6, 7, 8):
        assert resumed[step]["lr"] == first[step]["lr"]
        assert resumed[step]["loss"] == pytest.approx(first[step]["loss"], rel=1e-6)
    # Past the 8 steps the schedule was made for, the LR stays at min_lr instead of jumping back up.
    min_lr = first[8]["lr"]
    assert resumed[9]["lr"] == resumed[10]["lr"] == min_lr
    assert any("goes past the 8 steps" in r.getMessage() and "steps 9-10 train at optim.min_lr" in r.getMessage()
               for r in caplog.records)  # fmt: skip

    # New checkpoints do not take the broken ones' names (Ray's retention would delete them in their place).
    assert result.checkpoint_dir.name == "checkpoint_step_00000010"
    assert {p.name for p in run_copy.glob("checkpoint_step_*")} >= {"checkpoint_step_00000008-1"}
    state = json.loads((result.checkpoint_dir / TRAIN_STATE).read_text())
    assert state["step"] == 10 and state["schedule_steps"] == 8
    optimizer = torch.load(result.checkpoint_dir / OPTIMIZER_STATE, weights_only=True)
    assert int(next(iter(optimizer["state"].values()))["step"]) == 10
    assert checkpoint_problem(result.model_dir.parent / result.checkpoint_dir.name) is None


def test_no_whole_checkpoint_is_one_error_before_ray_train_starts(run_copy: Path, corpus: Path) -> None:
    for step in (2, 4, 6, 8):
        (step_dir(run_copy, step) / TRAIN_STATE).write_text("")
    with pytest.raises(CheckpointError) as error:
        fit(tiny_config(corpus, run_copy.parent, *OVERRIDES, "train.max_steps=10"))
    message = str(error.value)
    assert message.startswith(f"no checkpoint of {run_copy} can be resumed from: checkpoint_step_00000008 ")
    assert message.count("is not valid JSON") == 4 and "choose another run.name" in message
    assert [r.get("start_step") for r in history(run_copy) if r.get("event") == "start"] == [0], "nothing started"


def test_a_max_steps_below_the_run_is_refused(run_copy: Path, corpus: Path) -> None:
    with pytest.raises(ConfigError, match=r"^train.max_steps=5 is below step 8, where run 'resume' already is"):
        fit(tiny_config(corpus, run_copy.parent, *OVERRIDES, "train.max_steps=5"))


def test_a_checkpoint_that_fails_to_load_is_passed_over_too(trained: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from gpt2_platform.train.config import ModelConfig
    from gpt2_platform.train.loading import build_model
    from gpt2_platform.train.run_checkpoint import read_checkpoint

    run_dir = tmp_path / RUN_NAME
    for step in (6, 8):
        shutil.copytree(step_dir(trained, step), step_dir(run_dir, step))
    # Whole files, but weights of another shape (a checkpoint of another model): only the load can tell.
    save_file({"transformer.wte.weight": torch.zeros(3, 5)}, step_dir(run_dir, 8) / WEIGHTS_NAME)
    assert checkpoint_problem(step_dir(run_dir, 8)) is None
    model = build_model(ModelConfig(preset="tiny"))
    resume = choose_checkpoint(run_dir, load=lambda d: read_checkpoint(d, model, torch.device("cpu")))
    assert resume.directory == step_dir(run_dir, 6) and resume.loaded.optimizer["state"]
    (skipped,) = resume.skipped
    assert skipped.startswith("checkpoint_step_00000008 cannot be loaded (RuntimeError: Error(s) in loading")


def test_a_checkpoint_from_before_schedule_steps_uses_its_saved_max_steps(trained: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / RUN_NAME
    checkpoint = Path(shutil.copytree(step_dir(trained, 4), step_dir(run_dir, 4)))
    state = json.loads((checkpoint / TRAIN_STATE).read_text())
    assert state.pop("schedule_steps") == 8
    (checkpoint / TRAIN_STATE).write_text(json.dumps(state))
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    saved["train"]["max_steps"] = 30
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved))
    resume = choose_checkpoint(run_dir)
    assert (resume.step, resume.schedule_steps, resume.skipped) == (4, 30, [])
