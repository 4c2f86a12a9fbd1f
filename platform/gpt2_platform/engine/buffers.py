"""What the device keeps for each slot between steps, and the host buffers that steps' inputs and outputs
cross in: two of each, one for the step being set up and one for the step still in flight, pinned on CUDA so
that no copy waits for the host (a copy from pageable memory would wait for the step in flight)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpt2_platform.engine.config import MAX_LOGPROBS


class SlotState:
    """Decode state on the device, one column per slot (the scratch slot last); a graph reads columns [:B].

    Each step (and a prefill, for its slots) leaves its output token, position + 1 and step + 1 here, so the
    next step can run before the host has read this one's tokens; and a prefill sets its slots' sampling
    parameters here, from their staged header rows, for every later step.
    """

    def __init__(self, columns: int, device: torch.device) -> None:
        self.tokens = torch.zeros(columns, dtype=torch.long, device=device)
        self.positions = torch.zeros(columns, dtype=torch.long, device=device)
        self.steps = torch.zeros(columns, dtype=torch.long, device=device)
        self.temperature = torch.zeros(columns, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(columns, dtype=torch.long, device=device)
        self.top_p = torch.ones(columns, dtype=torch.float32, device=device)
        self.seed = torch.zeros(columns, dtype=torch.long, device=device)


def logprob_buffers(rows: int, pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host buffers for `rows` tokens' log-probabilities: (rows, 1 + MAX_LOGPROBS) values, (rows, MAX_LOGPROBS)
    top ids."""
    values = torch.zeros(rows, 1 + MAX_LOGPROBS, dtype=torch.float32, pin_memory=pinned)
    return values, torch.zeros(rows, MAX_LOGPROBS, dtype=torch.long, pin_memory=pinned)


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """One of a decode step's two sets of host buffers."""

    staged: torch.Tensor
    """`(4, slots + 1)`: what the host sets before a step, copied to the device in one go: rows token, position,
    step, and "fed" (1: take this column from here; 0: keep what the previous step left on the device)."""
    rows: np.ndarray
    """`staged`'s memory, written as an array."""
    tokens: torch.Tensor
    """`(slots,)`: the step's tokens, back from the device."""
    logprobs: tuple[torch.Tensor, torch.Tensor]
    """The step's log-probabilities (`logprob_buffers`), back from the device for steps that computed them."""

    @classmethod
    def allocate(cls, num_slots: int, pinned: bool) -> StepBuffers:
        staged = torch.zeros(4, num_slots + 1, dtype=torch.long, pin_memory=pinned)
        tokens = torch.zeros(num_slots, dtype=torch.long, pin_memory=pinned)
        return cls(staged, staged.numpy(), tokens, logprob_buffers(num_slots, pinned))


@dataclass(slots=True)
class PrefillBuffers:
    """One of a prefill's two sets of host buffers, and when it is free again."""

    prompts: torch.Tensor
    """`(slots, >= PROMPT_HEADER + context)`: padded prompt rows, each a header then the prompt's tokens."""
    packed: torch.Tensor
    """A packed prefill's whole input, flat (prefill.packed_layout)."""
    firsts: torch.Tensor
    """`(slots,)`: each prompt's first token, back from the device."""
    logprobs: tuple[torch.Tensor, torch.Tensor]
    """The first tokens' log-probabilities (`logprob_buffers`), back for prefills that computed them."""
    done: torch.cuda.Event | None = None
    """Recorded after the last prefill that used these buffers: they are free again once it has passed."""

    @classmethod
    def allocate(cls, prompt_columns: int, packed_length: int, num_slots: int, pinned: bool) -> PrefillBuffers:
        prompts = torch.zeros(num_slots, prompt_columns, dtype=torch.long, pin_memory=pinned)
        packed = torch.zeros(packed_length, dtype=torch.long, pin_memory=pinned)
        firsts = torch.zeros(num_slots, dtype=torch.long, pin_memory=pinned)
        return cls(prompts, packed, firsts, logprob_buffers(num_slots, pinned))


def hand_back(
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    host: torch.Tensor,
    count: int,
    host_logprobs: tuple[torch.Tensor, torch.Tensor],
    on_cuda: bool,
) -> Launch:
    """`out[:count]` (tokens, or tokens with their log-probabilities and top ids) on its way to the
    pinned host buffers without waiting; the Launch that waits for it."""
    logprobs = None
    if isinstance(out, tuple):
        out, values, ids = out
        logprobs = host_logprobs
        logprobs[0][:count].copy_(values[:count], non_blocking=True)
        logprobs[1][:count].copy_(ids[:count], non_blocking=True)
    host[:count].copy_(out[:count], non_blocking=True)
    done = None
    if on_cuda:
        done = torch.cuda.Event()
        done.record()
    return Launch(host, count, done, logprobs)


class Launch:
    """A decode step started by `ModelRunner.launch` (or a prefill); its tokens once the device has them."""

    def __init__(
        self,
        result: torch.Tensor,
        active: int,
        done: torch.cuda.Event | None,
        logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.result, self.active, self.done, self._logprobs = result, active, done, logprobs
        # An echo prefill's: (B, T - 1, 1 + MAX_LOGPROBS) values and (B, T - 1, MAX_LOGPROBS) ids, on the host.
        self.prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.result[: self.active].tolist()

    def array(self) -> np.ndarray:
        """The tokens as a numpy array of their own (the pinned buffer is reused by a later launch)."""
        if self.done is not None:
            self.done.synchronize()
        return self.result[: self.active].numpy().copy()

    def logprobs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After `array()` or `tokens()`: (active, 1 + MAX_LOGPROBS) log-probabilities (the token's, then
        the top ones') and (active, MAX_LOGPROBS) the top ids, when the launch computed them."""
        if self._logprobs is None:
            return None
        values, ids = self._logprobs
        return values[: self.active].numpy().copy(), ids[: self.active].numpy().copy()
