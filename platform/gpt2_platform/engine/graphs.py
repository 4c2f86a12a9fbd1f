"""The engine's CUDA graphs: shape buckets, and the cache that captures each (shape, mode) once, in one pool.

A graph is captured at warm-up or, for a shape first met later, on first use; each capture is timed by phase,
and those on first use are counted and logged, since they hold up the engine's thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpt2_platform.engine.modes import SamplingMode

logger = logging.getLogger(__name__)

Graph = tuple[torch.cuda.CUDAGraph, Any]
"""A captured graph and what its step returned: tensors that every replay fills."""
GraphKey = tuple[int, int, SamplingMode]
"""Two shape buckets (batch and span, batch and width, or prompts and tokens) and the sampling mode."""


def buckets(limit: int, start: int) -> list[int]:
    """Powers of two from `start` up to `limit`, ending with `limit` itself."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def bucket_for(value: int, sizes: list[int]) -> int:
    for size in sizes:
        if size >= value:
            return size
    raise AssertionError(f"{value} exceeds the largest bucket {sizes[-1]}")


class GraphCache:
    """The captured graphs of each kind of step by GraphKey, all in one memory pool, and what capturing cost."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.decode: dict[GraphKey, Graph] = {}  # (batch, span, mode)
        self.prefill: dict[GraphKey, Graph] = {}  # padded: (batch, width, mode)
        self.packed: dict[GraphKey, Graph] = {}  # packed prefill: (prompts, tokens, mode)
        self.captures = 0
        # Each capture's seconds by phase (the steps in flight, the eager run, the capture itself),
        # summed: what a replica's warm-up spends its time on, in its log line.
        self.capture_phases_s = [0.0, 0.0, 0.0]
        # Graphs captured after warm-up, when a shape is first met, and the seconds they took.
        self.captures_on_use = 0
        self.capture_on_use_s = 0.0
        self._warming = False
        self._pool = None

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Captures inside are warm-up's, not first uses."""
        self._warming = True
        try:
            yield
        finally:
            self._warming = False

    def capture(
        self,
        graphs: dict[GraphKey, Graph],
        key: GraphKey,
        step: Callable[[], Any],
        keep: tuple[torch.Tensor, ...] = (),
    ) -> Graph:
        """`step` captured as a CUDA graph into `graphs[key]`, with the tensors it returns (filled by every
        replay).

        `step` runs once first, outside the graph: that loads its kernels and sizes cuBLAS's workspace,
        which a capture cannot do. (It ran twice, as torch's examples do. The eager runs are most of a
        replica's warm-up, but it is each kernel's first use that costs, so dropping the second run saved
        little: docs/benchmarks.md, a Serve replica's start. The GPU tests compare the graphs with the
        eager model.) `keep` are tensors it changes that must hold, after the capture, what they held
        before (a graph captured on first use, mid-sequence). All graphs share one memory pool: each
        output is read (copied to the host) right after its replay, before any other graph runs on the
        stream and may reuse that memory.
        """
        marks = [time.perf_counter()]
        torch.cuda.synchronize(self.device)  # the steps in flight: timed apart from the capture's own work
        marks.append(time.perf_counter())
        saved = [t.clone() for t in keep]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for tensor, before in zip(keep, saved, strict=True):
            tensor.copy_(before)
        torch.cuda.synchronize(self.device)  # the eager run's time, apart from the capture's
        marks.append(time.perf_counter())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._shared_pool()):
            out = step()
        marks.append(time.perf_counter())
        self._account(marks)
        graphs[key] = (graph, out)
        return graph, out

    def _account(self, marks: list[float]) -> None:
        """A capture's phases, timed by `marks`, into the totals; and, after warm-up, into the job's log."""
        self.captures += 1
        for phase in range(3):
            self.capture_phases_s[phase] += marks[phase + 1] - marks[phase]
        if not self._warming:  # a capture on first use holds up the engine's thread: the job's log says so
            self.captures_on_use += 1
            self.capture_on_use_s += marks[-1] - marks[0]
            logger.info(
                "captured a graph on first use in %.3f s (the steps in flight %.3f s, an eager run %.3f s, "
                "the capture %.3f s)",
                marks[-1] - marks[0],
                marks[1] - marks[0],
                marks[2] - marks[1],
                marks[3] - marks[2],
            )

    def _shared_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool
