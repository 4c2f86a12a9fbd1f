"""The training loop's profiler: torch.profiler over a window of steps, written as Chrome traces."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from gpt2_platform import traces

logger = logging.getLogger(__name__)

# libkineto prints this once a process, with a bare fprintf that neither KINETO_LOG_LEVEL nor TORCH_CPP_LOG_LEVEL
# reaches, when the first profiler starts in a thread other than the one that loaded libtorch, and Ray Train runs
# this loop in a thread of its own. What it then skips is torch's set-up for MTIA devices: the trace is whole.
_KINETO_THREAD_NOTICE = b"External init callback must run in same thread as registerClient"


@contextlib.contextmanager
def _stderr_without(text: bytes) -> Iterator[None]:
    """Hold back what this process writes to its stderr meanwhile (any thread, C or Python), and write it
    afterwards less the lines that contain `text`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = memoryview(b"".join(line for line in held if text not in line))
            while kept:
                kept = kept[os.write(2, kept) :]


class Profiler:
    """torch.profiler over a window of optimizer steps, written as Chrome trace files (gpt2_platform/traces.py).

    Each step is a range of its own in the trace (`traces.STEP_PREFIX` and its number), so a summary and
    a timeline viewer show where one ends and the next begins.
    """

    def __init__(self, enabled: bool, window: list[int], out_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = window
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.profiler: torch.profiler.profile | None = None
        self.step_range: torch.profiler.record_function | None = None
        self.enabled = enabled

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(self.out_dir), worker_name=f"rank{self.rank}"
                ),
            )
            with _stderr_without(_KINETO_THREAD_NOTICE):
                self.profiler.__enter__()
        if self.profiler is not None:
            self.step_range = torch.profiler.record_function(f"{traces.STEP_PREFIX}{step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is None:
            return
        assert self.step_range is not None
        self.step_range.__exit__(None, None, None)
        if step < self.last:
            return
        self.profiler.__exit__(None, None, None)
        self.profiler = None
        if self.rank == 0:
            logger.info(
                "profiler trace of steps %d-%d written to %s; summary: python jobs/trace_summary.py %s; "
                "timeline: open it in %s",
                self.first,
                self.last,
                self.out_dir,
                self.out_dir,
                traces.VIEWER,
            )
