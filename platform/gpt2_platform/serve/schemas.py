"""What crosses the Serve boundary, as pydantic models: the app builder's args, live limits, and HTTP bodies.

Requests are validated strictly (no "5" for 5, no true for 1) and refuse
unknown fields, so a client learns about a typo or an unsupported OpenAI option
from a 400 instead of a silently different result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar, cast

from fastapi import Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.requests import ClientDisconnect

from gpt2_platform.engine.config import MAX_LOGPROBS, MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, EngineConfig
from gpt2_platform.moderation import ModerationConfig
from gpt2_platform.serve import errors
from gpt2_platform.serve.errors import APIError, bad_request

if TYPE_CHECKING:  # engine/requests.py brings torch; these schemas stay importable without it
    from gpt2_platform.engine.requests import TokenLogprob

# The request bounds are the engine's (engine/config.py), so what it would refuse gets a 400 naming the field.
MAX_INT64 = MAX_SEED  # the name serve/app.py checks seed + n - 1 against
Schema = TypeVar("Schema", bound=BaseModel)


class ServeLimits(BaseModel):
    """Per-replica limits, changeable live: Serve passes `user_config` to `reconfigure` without a restart."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(1_000_000, ge=1)
    """Largest request body accepted (413 above it), checked from Content-Length and while reading."""
    body_timeout_s: float = Field(10.0, gt=0.0, le=600.0)
    """Longest wait for a request's whole body once the replica has its headers (408 past it), so a
    client that declares a body and sends it slowly, or never, holds a replica's request slot only this long."""
    max_prompts: int = Field(32, ge=1)
    """Prompts in one /v1/completions request."""
    max_n: int = Field(8, ge=1)
    """Choices per prompt (`n`)."""
    max_stop: int = Field(4, ge=0)
    """Stop strings in one request (OpenAI allows 4)."""
    max_stop_chars: int = Field(128, ge=1)
    """Characters in one stop string: the engine holds back that much streamed text while it may still
    grow into a stop string, and checks every stop string against it at every token."""
    max_tokens_cap: int = Field(1024, ge=1)
    """Largest `max_tokens` a request may ask for."""
    default_max_tokens: int = Field(16, ge=1)
    """`max_tokens` when a request leaves it out (OpenAI's default is 16)."""
    max_queue_wait_s: float = Field(5.0, gt=0.0, le=600.0)
    """The wait budget: an engine with no free slot takes a request only if, at the rate its slots have been
    freeing, the request should start within this many seconds; past it, 429 with a Retry-After computed
    from that rate (engine/admission.py). A client that goes away while it waits frees its place at once."""
    max_waiting: int = Field(1024, ge=0)
    """Hard bound on sequences waiting for a slot in one engine, whatever its rate: what bounds the memory
    of the queue (prompts). Past it, requests get 429."""
    stream_interval_ms: float = Field(20.0, ge=0.0, le=1000.0)
    """Least time between two SSE chunks of one stream (the first and last go at once); 0: every token.

    Each chunk costs the replica a message to Serve's proxy, more host time than the token itself, so
    pacing the chunks lets a replica stream more tokens a second, to one client or to many; text then
    arrives in bursts of at most 50 a second at the default, with the same time to first token
    (docs/benchmarks.md, serving over HTTP)."""


class AppArgs(BaseModel):
    """The app builder's arguments (`args:` in deployments/gpt2.yaml); changing one restarts the replicas."""

    model_config = ConfigDict(extra="forbid")

    model: str = "runs/demo-tiny/model"
    """A Hugging Face model directory (e.g. what `make demo` exports) or a hub name (openai-community/gpt2)."""
    tokenizer: str | None = None
    """Tokenizer directory, hub name or 'byte'; None: the model's own (exported model dirs hold one)."""
    served_model_name: str | None = None
    """The name clients send as `model` and /v1/models lists; None: `model` as given."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The engine's settings (gpt2_platform.engine.config: batch size, context, dtype, CUDA graphs, compile,
    decode kernels, prefill budget), the same dataclass the batch job's `engine:` takes."""
    gpu_monitor: bool | None = None
    """Start the per-node GPU exporters (`jobs/monitor.py start`) with the app; None: if the cluster has GPUs."""
    api_key_env: str | None = None
    """Name of an environment variable holding the API key; None: no authentication."""
    limits: ServeLimits = Field(default_factory=ServeLimits)
    """Initial limits; a deployment's `user_config` overrides them live, key by key."""
    moderation: ModerationConfig = Field(default_factory=ModerationConfig)
    """Checks of prompts (400) and completions (withheld, finish_reason 'content_filter'); off by default."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_flat_engine_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "engine_process" in data:
            raise PydanticCustomError(
                "retired_key",
                "args.engine_process is gone: the engine now always runs in its own deployment; remove the key",
            )
        moved = [name for name in _ENGINE_KEYS if name in data]
        if moved:
            raise PydanticCustomError(
                "moved_key",
                "args.{keys} moved under `engine:` (e.g. args.engine.{first}); nest them there",
                {"keys": ", args.".join(moved), "first": moved[0]},
            )
        return data

    @field_validator("engine", mode="wrap")
    @classmethod
    def _engine_errors_name_the_field(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> EngineConfig:
        try:
            return handler(value)
        except ValidationError as error:
            raise PydanticCustomError("engine_config", "{problems}", {"problems": _engine_problems(error)}) from None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


_ENGINE_KEYS = tuple(field.name for field in dataclasses.fields(EngineConfig))


def _engine_problems(error: ValidationError) -> str:
    """Each problem with `args.engine` as `args.engine.<field>: why`; the dataclass's own checks name their field."""
    problems = []
    for item in error.errors():
        cause = (item.get("ctx") or {}).get("error")
        if item["type"] == "value_error" and isinstance(cause, ValueError):
            problems.append(f"args.{cause}")  # "engine.max_batch_size must be auto or an integer >= 1, got 0"
        else:
            where = ".".join(str(part) for part in item["loc"])
            problems.append(f"args.engine{'.' + where if where else ''}: {item['msg']}")
    return "; ".join(problems)


class _RequestBody(BaseModel):
    """A request body: strict types, no unknown fields, and an explicit null for a field that has a
    default means that default, as OpenAI's API reads it (`"temperature": null` is temperature 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, field in cls.model_fields.items() if not field.is_required()}
        return {key: value for key, value in data.items() if value is not None or key not in optional}


class StreamOptions(_RequestBody):
    include_usage: bool = False
    """Send a last chunk with the usage counts and no choices."""


class CompletionRequest(_RequestBody):
    """POST /v1/completions, as OpenAI defines it, plus top_k and ignore_eos."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    """0 only with echo: score the prompt (its tokens' log-probabilities), generate nothing."""
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Each token's log-probability and this many alternatives', under the raw logits."""
    echo: bool = False
    """The prompt comes back before the completion (with logprobs, its tokens' log-probabilities too)."""
    # OpenAI options this server does not implement: accepted only at their no-op values.
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first option asked for that this server cannot honour."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of other than n is not supported (got best_of={self.best_of}, n={self.n})"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            param = "presence_penalty" if self.presence_penalty != 0.0 else "frequency_penalty"
            return param, f"{param} is not supported by this server; leave it out or set it to 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def check(self, limits: ServeLimits, served_model: str) -> None:
        """Raise the OpenAI-style error for an unsupported option, another model, or a limit exceeded."""
        unsupported = self.unsupported()
        if unsupported is not None:
            raise bad_request(unsupported[1], unsupported[0], "unsupported_option")
        if self.model is not None and self.model != served_model:
            message = f"model {self.model!r} is not served here; this server serves {served_model!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        num_prompts = len(self.prompt_list())
        if num_prompts == 0:
            raise bad_request("prompt is empty; send a string or a list of strings", "prompt")
        if num_prompts > limits.max_prompts:
            raise bad_request(f"{num_prompts} prompts, over this server's limit of {limits.max_prompts}", "prompt")
        if self.n > limits.max_n:
            raise bad_request(f"n is {self.n}, over this server's limit of {limits.max_n}", "n")
        stops = self.stop_strings()
        if len(stops) > limits.max_stop:
            raise bad_request(f"{len(stops)} stop strings, over this server's limit of {limits.max_stop}", "stop")
        if any(not stop for stop in stops):
            raise bad_request("stop strings must not be empty", "stop")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            message = f"a stop string of {longest} characters, over this server's limit of {limits.max_stop_chars}"
            raise bad_request(message, "stop", "stop_too_long")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1, or 0 with echo (to score the prompt)", "max_tokens")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens_cap:
            message = f"max_tokens is {self.max_tokens}, over this server's limit of {limits.max_tokens_cap}"
            raise bad_request(message, "max_tokens")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        # A list of prompts; a non-empty list of ids, which mypy cannot rule out here, was one prompt, above.
        return list(cast("list[str] | list[list[int]]", self.prompt))

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _is_token_ids(prompt: object) -> TypeGuard[list[int]]:
    """Whether a completion's `prompt` is one prompt given as token ids (not a list of prompts)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(item, int) for item in prompt)


class GenerateRequest(_RequestBody):
    """POST /generate: the seed project's simple endpoint, kept for its clients."""

    prompt: str
    max_length: int = Field(50, ge=1)
    """Prompt plus generated tokens, as in transformers' `generate(max_length=...)`."""
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    """0 is greedy."""


def _refuse_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, schema: type[Schema], limits: ServeLimits) -> Schema:
    """The body, parsed and validated: 413 over `limits.max_body_bytes` (declared or read), 408 when it
    has not all arrived within `limits.body_timeout_s`, 499 when the client hung up, 400 for anything malformed."""
    max_body_bytes = limits.max_body_bytes
    too_large = APIError(413, f"request body is over the limit of {max_body_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise bad_request("invalid Content-Length header")
    if declared is not None and int(declared) > max_body_bytes:
        raise too_large
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > max_body_bytes:
                raise too_large

    try:
        # One deadline for the whole body, not per chunk: a client sending a byte every few seconds
        # would otherwise hold its request slot for as long as it likes. (wait_for, not asyncio.timeout,
        # which Python 3.10 lacks.)
        await asyncio.wait_for(receive(), limits.body_timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        received = f"{len(body)} of {declared} bytes" if declared is not None else f"{len(body)} bytes"
        raise errors.request_timeout(
            f"the request body did not arrive within {limits.body_timeout_s:g} s ({received} received); "
            "send the whole body at once"
        ) from None
    except ClientDisconnect:
        raise errors.client_closed("the client closed the connection before its request body arrived") from None
    try:
        data = json.loads(body, parse_constant=_refuse_json_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from None
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise errors.from_validation_error(error) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(
    index: int, text: str, finish_reason: str | None, seed: int | None = None, logprobs: dict | None = None
) -> dict[str, Any]:
    """One choice; `seed` (an extension of OpenAI's shape) is the sampling seed it ran with, so an
    unseeded request can be reproduced by sending it back."""
    body: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if seed is not None:
        body["seed"] = seed
    return body


def logprobs(
    tokens: list[int], entries: list[TokenLogprob | None], offset: int, token_text: Callable[[int], str]
) -> dict[str, list]:
    """OpenAI's `logprobs` object of a completions choice: each token's text, its log-probability, the
    most likely tokens' as {text: log-probability} (null where there is none: an echoed prompt's first
    token), and where each token's text starts in the choice's text, counted from `offset`."""
    texts = [token_text(token) for token in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if entry is None else entry[0] for entry in entries],
        "top_logprobs": [None if entry is None else {token_text(i): lp for i, lp in entry[1]} for entry in entries],
        "text_offset": offsets,
    }


def completion(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    """A /v1/completions response body, or one streamed chunk of it."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def model_card(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One model as OpenAI's /v1/models lists it, plus its context length."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "gpt2-platform",
        "max_model_len": max_model_len,
    }


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def now_s() -> int:
    return int(time.time())
