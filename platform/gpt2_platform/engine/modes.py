"""How a step picks its tokens: the sampling mode that selects, and keys, each CUDA graph of a shape."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Pick(StrEnum):
    """How a step picks each row's next token, one graph per shape each. A str, so that callers and configs
    name the picks to warm up by their strings ("greedy")."""

    GREEDY = "greedy"
    """Argmax only: every row has temperature 0."""
    PLAIN = "plain"
    """Sampling without top-k or top-p: no sort of the vocabulary."""
    FILTERED = "filtered"
    """Sampling where some row sets top-k or top-p: every row goes through the filters."""


class SamplingMode(NamedTuple):
    """A step's pick and whether it computes log-probabilities; part of each graph's key.

    A tuple rather than a dataclass: every decode step looks its graph up by it, and a tuple hashes in C.
    """

    pick: Pick
    logprobs: bool
    """Some row asks for log-probabilities: a graph of its own, captured on first use, so that steps nobody
    asks them of run exactly as without."""


# Every mode, made once: a step picks one of these rather than building a new one.
_WITHOUT_LOGPROBS = tuple(SamplingMode(pick, False) for pick in Pick)  # greedy, plain, filtered
_WITH_LOGPROBS = tuple(SamplingMode(pick, True) for pick in Pick)


def mode_of(greedy: list[bool], limited: list[bool], logprobs: list[bool]) -> SamplingMode:
    """The mode of a step over rows with these flags (temperature 0; top-k or top-p set; log-probabilities
    asked for): greedy if every row is, else filtered if any row is limited, else plain."""
    greedy_mode, plain, filtered = _WITH_LOGPROBS if any(logprobs) else _WITHOUT_LOGPROBS
    return greedy_mode if all(greedy) else filtered if any(limited) else plain
