"""Per-row logic of batch generation: ids, seeds, validation of a row into an engine request, the output schema.

Pure functions, no Ray: the actor in `worker.py` applies them to each batch.
A bad row becomes an error row (`error` = "<kind>: <what is wrong>"), never an exception. A row that
moderation blocks is one too (kind blocked_prompt or blocked_completion, finish_reason content_filter).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from numbers import Integral, Real

import pyarrow as pa

from gpt2_platform.batch.config import GenerationConfig
from gpt2_platform.engine.config import MAX_SEED, MAX_TEMPERATURE
from gpt2_platform.engine.engine import GenerationParams
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.moderation import CONTENT_FILTER, Verdict

OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
        ("model", pa.string()),
        ("model_sha256", pa.string()),
        ("seed", pa.int64()),
        ("max_tokens", pa.int64()),
        ("temperature", pa.float64()),
        ("truncated_tokens", pa.int64()),
        ("run_id", pa.string()),
    ]
)
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)
LOGPROBS_COLUMN = "logprobs"
"""With generation.logprobs: each generated token's log-probability, a list per row (null for an error row)."""


def output_schema(logprobs: bool) -> pa.Schema:
    """The output's columns: OUTPUT_SCHEMA, and the logprobs column when the job writes it (only then, so
    outputs written without it keep resuming)."""
    return OUTPUT_SCHEMA.append(pa.field(LOGPROBS_COLUMN, pa.list_(pa.float64()))) if logprobs else OUTPUT_SCHEMA


MODERATION_KINDS = ("blocked_prompt", "blocked_completion")
"""Error kinds of rows moderation blocked; their finish_reason is content_filter."""

# Ray's read_parquet(include_row_hash=True) gives each row splitmix64(md5(path)[:8] + row index) (Ray 2.60,
# pinned). splitmix64's finaliser is a bijection, so the row index comes back exactly: derived ids are
# '<file name>:<row index>', readable and independent of where the file lies. The inverse multipliers:
_MASK64 = (1 << 64) - 1
_UNMIX1 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64)
_UNMIX2 = pow(0x94D049BB133111EB, -1, 1 << 64)


def _unmix64(x: int) -> int:
    """The inverse of the splitmix64 finaliser."""
    x ^= (x >> 31) ^ (x >> 62)
    x = (x * _UNMIX2) & _MASK64
    x ^= (x >> 27) ^ (x >> 54)
    x = (x * _UNMIX1) & _MASK64
    x ^= (x >> 30) ^ (x >> 60)
    return x


def row_index(path: str, row_hash: int) -> int:
    """The row's index in its file, recovered from Ray's row hash."""
    path_seed = int.from_bytes(hashlib.md5(path.encode("utf-8")).digest()[:8], byteorder="little")
    return (_unmix64(row_hash) - path_seed) & _MASK64


def derived_id(path: str, row_hash: int) -> str:
    """'<file name>:<row index>' for an input without an id column."""
    return f"{os.path.basename(path)}:{row_index(path, row_hash)}"


def derive_seed(global_seed: int, row_id: str) -> int:
    """A 63-bit seed from the global seed and the row id (sha256: the same on every machine and Python)."""
    digest = hashlib.sha256(f"{global_seed}\x00{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class RowError(ValueError):
    """A row the job cannot generate for; `kind` groups it in the summary."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass
class Request:
    """A validated row: what the engine gets, and what the output records about it."""

    prompt_ids: list[int]
    params: GenerationParams
    truncated_tokens: int


@dataclass
class RowValues:
    """The row's effective settings (recorded even for error rows, as far as they are known)."""

    max_tokens: int | None
    temperature: float | None
    seed: int | None


def resolve_values(
    row_id: str, max_tokens: object, temperature: object, seed: object, defaults: GenerationConfig
) -> tuple[RowValues, RowError | None]:
    """The row's max_tokens, temperature and seed (its column value, else the default), and the first bad one.

    The values known so far are returned with the error, so that an error row still says what it used.
    """
    values = RowValues(defaults.max_tokens, defaults.temperature, None)
    if max_tokens is not None:
        values.max_tokens = None  # until the row's own value proves valid
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, Real) or not float(max_tokens).is_integer():
            return values, RowError("bad_max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        # typeshed's numbers.Real lacks __int__ (its stubs say they are incomplete); int() of a Real works
        row_max_tokens = int(max_tokens)  # type: ignore[call-overload]
        if row_max_tokens < 1:
            return values, RowError("bad_max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        values.max_tokens = row_max_tokens
    if temperature is not None:
        values.temperature = None
        if isinstance(temperature, bool) or not isinstance(temperature, Real) or not math.isfinite(temperature):
            message = f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}"
            return values, RowError("bad_temperature", message)
        if not 0.0 <= float(temperature) <= MAX_TEMPERATURE:
            message = f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}"
            return values, RowError("bad_temperature", message)
        values.temperature = float(temperature)
    if seed is None:
        values.seed = derive_seed(defaults.seed, row_id)
    elif isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= int(seed) <= MAX_SEED:
        return values, RowError("bad_seed", f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    else:
        values.seed = int(seed)
    return values, None


def build_request(
    prompt: object, prompt_ids: list[int] | None, values: RowValues, defaults: GenerationConfig, max_seq_len: int
) -> Request:
    """Check the prompt against the context and build the engine request; RowError if it cannot run."""
    if prompt is None:
        raise RowError("null_prompt", "the prompt is null")
    if not isinstance(prompt, str) or not prompt or not prompt_ids:
        raise RowError("empty_prompt", "the prompt is empty")
    assert values.max_tokens is not None and values.temperature is not None and values.seed is not None
    budget = max_seq_len - values.max_tokens
    if budget < 1:
        raise RowError(
            "bad_max_tokens",
            f"max_tokens {values.max_tokens} leaves no room for a prompt in the context of {max_seq_len} tokens",
        )
    truncated = 0
    if len(prompt_ids) > budget:
        if defaults.long_prompts == "reject":
            raise RowError(
                "prompt_too_long",
                f"the prompt is {len(prompt_ids)} tokens; with max_tokens {values.max_tokens} it exceeds the "
                f"context of {max_seq_len} tokens (generation.long_prompts=truncate keeps its last {budget})",
            )
        truncated = len(prompt_ids) - budget
        prompt_ids = prompt_ids[-budget:]
    sampling = SamplingParams(
        temperature=values.temperature, top_k=defaults.top_k, top_p=defaults.top_p, seed=values.seed
    )
    params = GenerationParams(
        max_tokens=values.max_tokens,
        stop=tuple(defaults.stop),
        ignore_eos=defaults.ignore_eos,
        sampling=sampling,
        logprobs=0 if defaults.logprobs else None,
    )
    return Request(prompt_ids, params, truncated)


def blocked_by_moderation(verdict: Verdict) -> RowError:
    """The error of a row whose prompt or completion moderation blocked: kind blocked_prompt / blocked_completion."""
    return RowError(f"blocked_{verdict.kind}", f"blocked by moderation: {verdict.reason}")


def finish_reason(completion_finish_reason: str | None, error: str | None) -> str:
    """A row's finish_reason: the engine's if it generated cleanly, content_filter if moderation blocked it."""
    if error_kind(error) in MODERATION_KINDS:
        return CONTENT_FILTER
    return completion_finish_reason if error is None and completion_finish_reason else "error"


def error_kind(error: str | None) -> str | None:
    """The kind of an `error` value ('<kind>: <message>')."""
    return None if error is None else error.split(":", 1)[0]
