"""What goes in and out of the engine: a request's parameters, the events and completions
it hands back, and the checks a request must pass. Plain data, shared by the engine, the engine process
and the servers in front of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# Re-exported: the engine and its process import the config from here.
from gpt2_platform.engine.config import MAX_LOGPROBS, EngineConfig, SamplingParams  # noqa: F401


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    """Tokens to generate at most."""
    stop: tuple[str, ...] = ()
    """Strings that end the generation; they are not part of the text."""
    ignore_eos: bool = False
    """Keep generating past the end-of-text token."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    """None: no log-probabilities. 0 to MAX_LOGPROBS: each generated token's log-probability, with that
    many of the most likely tokens at its position and theirs, under the raw logits (before temperature,
    top-k and top-p)."""
    echo: bool = False
    """With logprobs: the prompt's tokens' log-probabilities too (the first token has none). Allows
    max_tokens 0: score the prompt, generate nothing."""


@dataclass(slots=True)  # one per token per sequence: slots make them cheaper to build and read
class Event:
    """What one request got from one engine step."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seed: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with echo: one per prompt token, the first None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]
"""A generated token's log-probability, and the most likely tokens at its position as (id, log-probability)."""


def logprob_entries(values, ids, top: int) -> list[TokenLogprob]:
    """TokenLogprobs from a launch's arrays (engine/buffers.py, Launch): `values` (N, 1 + MAX_LOGPROBS), the
    token's log-probability then the top ones'; `ids` (N, MAX_LOGPROBS); `top` alternatives kept."""
    return [
        (lp, tuple(zip(top_ids, top_lps, strict=True)))
        for lp, top_ids, top_lps in zip(
            values[:, 0].tolist(), ids[:, :top].tolist(), values[:, 1 : 1 + top].tolist(), strict=True
        )
    ]


@dataclass(slots=True)
class LogprobStream:
    """One sequence's log-probabilities on their way to its consumer: each token's as it comes in, handed
    out with the tokens that events carry, and the prompt's (echo) once, with the first hand-out."""

    tokens: list[TokenLogprob] = field(default_factory=list)
    sent: int = 0
    prompt: list[TokenLogprob | None] | None = None

    def take(self, count: int) -> tuple[list[TokenLogprob], list[TokenLogprob | None] | None]:
        """The next `count` tokens' log-probabilities, and the prompt's if not handed out yet."""
        start, self.sent = self.sent, self.sent + count
        prompt, self.prompt = self.prompt, None
        return self.tokens[start : self.sent], prompt


Deliver = Callable[[list[tuple[Callable[[Event], None], Event]]], None]
"""What `deliver_in_batches` takes: a function given one engine step's events as (on_event, event) pairs."""


TokenRecord = tuple
"""A sequence's output as a token sink takes it: (key, token or -1, finish reason or None, error or None), and
for a sequence that asked for log-probabilities a fifth item, (the token's TokenLogprob or None, the prompt's
log-probabilities with echo, sent once, or None)."""


class TokenSink(Protocol):
    """Where the engine puts the tokens of the sequences submitted with it (`Engine.submit`):
    one record per token, gathered during an engine iteration and sent once at its end. No Event is
    built for them: at hundreds of sequences a step, that per-token object was a large share of the
    engine's host time (engine/messages.py's StepSink is the base of the package's sinks)."""

    pending: list[TokenRecord]
    """Records of the iteration so far; the engine appends each token's record here."""

    def add(self, record: TokenRecord, num_generated: int) -> None:
        """Take a sequence's last record (a finish reason set), and how many tokens it generated in all."""

    def send(self) -> bool:
        """Send the pending records on; False if the consumer is gone."""


@dataclass
class Completion:
    """A finished request, as `generate()` returns it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seed: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with echo and logprobs: one per prompt token


class EngineDeadError(RuntimeError):
    """The engine loop stopped; the replica must be replaced."""


def scoring_only(params: GenerationParams) -> bool:
    """An echoed prompt with max_tokens 0: nothing is generated, so its last token is only ever a target, never
    an input, and the prompt may be one token longer than the context (a training block of context + 1
    tokens scores its context's every position, as the training loss does)."""
    return params.echo and params.max_tokens == 0


def validate_request(prompt_ids: list[int], params: GenerationParams, max_seq_len: int, vocab_size: int) -> None:
    """Raise ValueError for a request an engine of this context and vocabulary cannot take, naming what is wrong."""
    if not prompt_ids:
        raise ValueError("prompt is empty; send at least one token of text")
    if params.max_tokens < (0 if params.echo else 1):
        raise ValueError(f"max_tokens must be >= 1 (0 only with echo), got {params.max_tokens}")
    total = len(prompt_ids) + params.max_tokens
    if scoring_only(params) and len(prompt_ids) > max_seq_len + 1:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) is over the {max_seq_len + 1} tokens a scored prompt may hold "
            f"(the context of {max_seq_len}, plus a last token that is only scored); shorten the prompt"
        )
    if not scoring_only(params) and total > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total}, over the "
            f"context of {max_seq_len} tokens; shorten the prompt or lower max_tokens"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:  # min/max: C loops, not one Python step a token
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab_size})")
    params.sampling.validate()
    if params.logprobs is not None and (
        isinstance(params.logprobs, bool)
        or not isinstance(params.logprobs, int)
        or not 0 <= params.logprobs <= MAX_LOGPROBS
    ):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {params.logprobs!r}")
