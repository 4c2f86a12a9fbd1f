"""Token sampling on the device: per-row temperature, top-k, top-p and seed, with no host synchronisation.

`sample` reads no tensor value on the host (no `.item()`, no branch on data,
no `torch.Generator`), so it runs inside a captured CUDA graph and under
`torch.compile(fullgraph=True)`. Randomness is a counter-based hash of
(seed, step, vocab id) turned into Gumbel noise: a row's token depends only on
its own logits and parameters, never on the rest of the batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# SamplingParams lives with the engine's other settings, which import no torch (a Serve replica that only
# routes to an engine process need not load it); imported here too, where the sampling code is.
from gpt2_platform.engine.config import SamplingParams  # noqa: F401

# The nucleus is complete once the mass before a token reaches top_p; the slack
# keeps float rounding of a sum that hits top_p exactly from adding one more token.
_TOP_P_SLACK = 1e-6


def _int64(unsigned: int) -> int:
    """The int64 with the same 64 bits as an unsigned constant."""
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


# splitmix64 (Steele et al., 2014) constants, as int64 so tensor ops take them.
_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64: `>>` is arithmetic, so clear the copied sign bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """The splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seed: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise (B, V) in float64, a pure function of (seed, step, vocab id) per element."""
    row_key = _mix64(_mix64(seed) + step * _GOLDEN)  # (B,): one stream per (seed, step)
    vocab_ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)  # (V,)
    # The id goes in by xor, not by a multiply: int64 overflow is undefined behaviour in inductor's C++
    # kernels, and a wrapping multiply of the loop index let GCC miscompile them (torch 2.13, CPU).
    bits = _mix64(row_key[:, None] ^ vocab_ids)  # (B, V)
    # 52 random bits plus one half: u lies in [2**-53, 1 - 2**-53], exactly representable, never 0 or 1.
    uniform = (_shift_right(bits, 12).double() + 0.5) * 2.0**-52  # (B, V)
    return -torch.log(-torch.log(uniform))


def _filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its nucleus (B, V)."""
    vocab_size = logits.shape[-1]
    # Sorted probabilities, not logits: the same order, and the cumsum then reads a plain buffer (torch 2.11's
    # inductor fails to generate a CUDA split scan that broadcasts a per-row value). float64, so that rounding
    # differences between eager, compiled and batch shapes practically never move a top-p boundary.
    probs = torch.softmax(logits.double(), dim=-1)  # (B, V)
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values  # (B, V)
    cumulative = torch.cumsum(sorted_probs, dim=-1)  # (B, V), non-decreasing
    # Top-k as a threshold on the k-th largest value: ties with it stay, whatever the sort order.
    num_top_k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # (B,)
    kth_largest = sorted_probs.gather(-1, (num_top_k - 1)[:, None])  # (B, 1)
    num_top_k_kept = (sorted_probs >= kth_largest).sum(-1)  # (B,)
    top_k_mass = cumulative.gather(-1, (num_top_k_kept - 1)[:, None])  # (B, 1)
    # Top-p on what top-k kept: the tokens whose cumulative mass is still below top_p, and the one reaching it.
    below_top_p = cumulative < (top_p.double() - _TOP_P_SLACK)[:, None] * top_k_mass  # (B, V)
    num_nucleus = torch.where(top_p >= 1.0, vocab_size, below_top_p.sum(-1) + 1)  # (B,)
    # Both filters keep a prefix of the sorted row (at least the top token); its last value is the threshold.
    num_kept = torch.minimum(num_nucleus, num_top_k_kept).clamp(1, vocab_size)  # (B,)
    threshold = sorted_probs.gather(-1, (num_kept - 1)[:, None])  # (B, 1)
    return logits.masked_fill(probs < threshold, -math.inf)


def sample(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, step: Tensor, filtered: bool = True
) -> Tensor:
    """Draw one token id per row (B,) int64 from logits (B, V), each row with its own parameters.

    temperature (B,) float32, 0 = greedy (argmax of the raw logits, lowest id on ties);
    top_k (B,) int64, 0 = no limit; top_p (B,) float32 in (0, 1], 1 = no limit;
    seed (B,) int64; step (B,) int64, the index of the token being generated (0 for the first).
    Sampled rows divide by the temperature, keep the top-k, then the nucleus, and take
    argmax(logits + Gumbel noise) with the noise keyed by (seed, step, original vocab id).
    `filtered=False` skips the top-k/top-p sort: the same result when no row limits them
    (top_k 0, top_p 1, OpenAI's defaults), for a fraction of the cost.
    """
    assert logits.dim() == 2, f"logits must be (B, V), got {tuple(logits.shape)}"
    logits = logits.float()  # (B, V)
    greedy = temperature <= 0  # (B,)
    greedy_ids = torch.argmax(logits, dim=-1)  # (B,)
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)  # (B,): no 0/0 in greedy rows
    scaled = logits / safe_temperature[:, None].float()  # (B, V)
    if filtered:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)  # (B, V)
    noise = gumbel_noise(seed, step, logits.shape[-1])  # (B, V) float64
    sampled_ids = torch.argmax(scaled.double() + noise, dim=-1)  # (B,)
    return torch.where(greedy, greedy_ids, sampled_ids)


def token_logprobs(logits: Tensor, chosen: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """Log-probabilities under the raw logits (B, V), before any temperature, top-k or top-p.

    Returns (B, 1 + top) float32: the chosen token's (B,) log-probability, then the `top` most likely
    tokens'; and (B, top) int64: those tokens' ids, most likely first. No host synchronisation: it runs
    inside a captured graph.
    """
    logits = logits.float()
    total = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, 1)
    chosen_logprob = logits.gather(-1, chosen[:, None]) - total  # (B, 1)
    values, ids = torch.topk(logits, top, dim=-1)  # (B, top)
    return torch.cat([chosen_logprob, values - total], dim=-1), ids


def params_to_tensors(params: list[SamplingParams], steps: list[int], device: torch.device | str) -> dict[str, Tensor]:
    """The five per-row tensors `sample` takes (temperature, top_k, top_p, seed, step), each (B,), on `device`."""
    if len(params) != len(steps):
        raise ValueError(f"params and steps must have the same length, got {len(params)} and {len(steps)}")
    unresolved = [index for index, p in enumerate(params) if p.seed is None]
    if unresolved:
        raise ValueError(f"params at rows {unresolved} have seed=None; pass SamplingParams.resolved() copies")
    return {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        "seed": torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
        "step": torch.tensor(steps, dtype=torch.int64, device=device),
    }
