"""history.jsonl, a run's record in its directory: a line for each attempt's start and each report."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

HISTORY = "history.jsonl"


def append_history(run_dir: Path, record: dict) -> None:
    with (run_dir / HISTORY).open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_history(run_dir: Path, start_step: int) -> None:
    """Drop the step records past `start_step` from history.jsonl, keeping every start record.

    An attempt that failed after its last checkpoint logged steps the next attempt redoes: without this each
    of them would appear twice. Rewritten through a temporary file, so a crash leaves the old or the new
    history, never half of one.
    """
    path = run_dir / HISTORY
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a worker that died while writing it
            logger.warning("dropping a broken line of %s: %.80s", path, line)
            continue
        if record.get("step", 0) <= start_step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    temporary = path.with_name(f".{HISTORY}.{os.getpid()}.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)
