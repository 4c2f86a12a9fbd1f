"""Which checkpoint a run resumes from: the newest one that is whole, never one that is not.

A run directory holds `checkpoint_step_*` directories (Ray Train keeps the last
`train.keep_checkpoints`). One may be broken: a copy cut short, a file truncated
or emptied by hand, a full disk. Each is checked for every file being present and
whole (JSON and YAML parse, the safetensors header covers the file, the torch zip
archives have their central directory) before it is used, and a broken one is
passed over for the next older one, with the reason. The driver checks before the
run starts (so a run with no whole checkpoint is refused with one line); workers
check again and also fall back if the full load of a checkpoint fails.
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from safetensors import safe_open

from gpt2_platform import checkpoint as ckpt

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_step_"
TRAIN_STATE = "train_state.json"
OPTIMIZER_STATE = "optimizer.pt"
SCALER_STATE = "scaler.pt"
RUN_CONFIG = "config.yaml"
REQUIRED_FILES = (ckpt.CONFIG_NAME, ckpt.WEIGHTS_NAME, OPTIMIZER_STATE, TRAIN_STATE, RUN_CONFIG)
_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)(?:-(\d+))?$")

T = TypeVar("T")


class CheckpointError(ValueError):
    """No checkpoint of the run can be resumed from; the message lists each one and why."""


@dataclass
class Resume(Generic[T]):
    """The checkpoint chosen: where, its step, the schedule length it trained under, what was passed over."""

    directory: Path
    step: int
    tokens_seen: int
    schedule_steps: int
    skipped: list[str] = field(default_factory=list)
    loaded: T | None = None


def checkpoint_dir_name(run_dir: Path, step: int) -> str:
    """A new checkpoint's directory name; a suffix where a broken one of the same step is still there
    (after a fallback), so that Ray's retention never deletes the new one in place of the old."""
    name = f"{CHECKPOINT_PREFIX}{step:08d}"
    attempt = 0
    while (run_dir / name).exists():
        attempt += 1
        name = f"{CHECKPOINT_PREFIX}{step:08d}-{attempt}"
    return name


def checkpoints_newest_first(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories by step (then by suffix), newest first."""
    if not run_dir.is_dir():
        return []
    found = []
    for path in run_dir.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append(((int(match.group(1)), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found, reverse=True)]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path.name} is not valid JSON ({error})") from error


def checkpoint_problem(directory: Path) -> str | None:
    """Why `directory` cannot be resumed from, or None if every file is present and whole."""
    if not directory.is_dir():
        return "is missing"
    if not any(directory.iterdir()):
        return "is empty"
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        return f"has no {', '.join(missing)}"
    try:
        state = _read_json(directory / TRAIN_STATE)
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and state["step"] >= 0):
            return f"{TRAIN_STATE} holds no step count"
        if not isinstance(_read_json(directory / ckpt.CONFIG_NAME), dict):
            return f"{ckpt.CONFIG_NAME} is not a JSON object"
    except ValueError as error:
        return str(error)
    try:
        if not isinstance(yaml.safe_load((directory / RUN_CONFIG).read_text()), dict):
            return f"{RUN_CONFIG} is not a mapping"
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        return f"{RUN_CONFIG} is not valid YAML ({str(error).splitlines()[0]})"
    try:
        with safe_open(str(directory / ckpt.WEIGHTS_NAME), framework="pt") as weights:
            if not list(weights.keys()):
                return f"{ckpt.WEIGHTS_NAME} holds no tensors"
    except Exception as error:  # safetensors raises its own (Rust) error type for a cut or garbled file
        return f"{ckpt.WEIGHTS_NAME} is unreadable ({error})"
    for name in (OPTIMIZER_STATE, SCALER_STATE):
        path = directory / name
        if path.exists():
            try:  # torch.save writes a zip archive: a cut file has lost its central directory at the end
                with zipfile.ZipFile(path) as archive:
                    archive.infolist()
            except (zipfile.BadZipFile, OSError) as error:
                return f"{name} is truncated or not a torch file ({error})"
    return None


def _schedule_steps(directory: Path, state: dict) -> int:
    """The schedule length the checkpoint trained under: recorded in its state since it was kept there;
    before that, the train.max_steps of its saved config."""
    if isinstance(state.get("schedule_steps"), int):
        return state["schedule_steps"]
    saved = yaml.safe_load((directory / RUN_CONFIG).read_text())
    return int(saved.get("train", {}).get("max_steps", state["step"]))


def choose_checkpoint(
    run_dir: Path, latest: Path | None = None, load: Callable[[Path], T] | None = None
) -> Resume[T] | None:
    """The newest whole checkpoint of the run (Ray's latest first, if given), or None if it has none.

    `load` (a worker's full load) is tried on each whole-looking one; if it raises, that checkpoint is
    passed over too. Raises CheckpointError if checkpoints exist but none can be used.
    """
    candidates = checkpoints_newest_first(run_dir)
    if latest is not None:
        latest = latest.resolve()
        candidates = [latest, *(path for path in candidates if path.resolve() != latest)]
    skipped: list[str] = []
    for directory in candidates:
        problem = checkpoint_problem(directory)
        loaded = None
        if problem is None and load is not None:
            try:
                loaded = load(directory)
            except Exception as error:  # whatever a broken file makes torch/safetensors raise
                problem = f"cannot be loaded ({type(error).__name__}: {error})"
        if problem is not None:
            skipped.append(f"{directory.name} {problem}")
            continue
        state = json.loads((directory / TRAIN_STATE).read_text())
        return Resume(
            directory=directory,
            step=state["step"],
            tokens_seen=int(state.get("tokens_seen", 0)),
            schedule_steps=_schedule_steps(directory, state),
            skipped=skipped,
            loaded=loaded,
        )
    if skipped:
        raise CheckpointError(
            f"no checkpoint of {run_dir} can be resumed from: {'; '.join(skipped)}. Move {run_dir} away "
            "(or choose another run.name) to start over"
        )
    return None
