"""The Serve application: FastAPI ingress replicas in front of an engine deployment.

    serve run deployments/gpt2.yaml

`GPT2Server` replicas (CPU only, as many as the HTTP load needs) do HTTP, validation, moderation,
tokenizing, detokenizing and SSE; `GPT2Engine` replicas (serve/engine_deployment.py, one per GPU or
GPU share) batch every sequence the ingresses send them. A sequence is a Serve call to an engine;
its tokens come back on the ingress's token link, one message per engine step (engine/link.py).

Routes: POST /v1/completions (OpenAI, with SSE streaming), GET /v1/models and
/v1/models/{id}, POST /generate (the seed project's simple endpoint), GET /health and
GET /v1/engine/stats (the engine's own counters: how it actually batched).
POST /v1/chat/completions answers that this model has no chat template.
"""

# No `from __future__ import annotations` here: Serve converts a builder's args
# to its pydantic model only when the annotation is the class itself, not a string.

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from transformers import PreTrainedTokenizerBase

from gpt2_platform import checkpoint, gc_pauses
from gpt2_platform.engine.admission import Admission, Refusal
from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.requests import EngineDeadError, Event, GenerationParams, scoring_only
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.moderation import CONTENT_FILTER, CompletionGuard, Moderator, Verdict, build_moderator
from gpt2_platform.serve import errors, schemas
from gpt2_platform.serve.autoscaling import BODIES_IN_FLIGHT
from gpt2_platform.serve.engine_client import RemoteEngine
from gpt2_platform.serve.engine_deployment import GPT2Engine
from gpt2_platform.serve.errors import APIError, bad_request
from gpt2_platform.serve.metrics import ServeMetrics
from gpt2_platform.serve.streams import Choices, Job, ShownPrompt, Update
from gpt2_platform.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

app = FastAPI(title="gpt2-platform", docs_url=None, redoc_url=None)
errors.install_handlers(app)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# The Retry-After of a 503 when the engine died: about the time Serve takes to notice (the engine's
# health_check_period_s) and start a replacement replica of a small model.
_ENGINE_DEAD_RETRY_AFTER_S = 5


def _engine_failed(event: Event) -> APIError:
    return errors.unavailable(
        f"generation failed: {event.error}; retry the request", _ENGINE_DEAD_RETRY_AFTER_S, "engine_failed"
    )


# Prompts up to this size tokenize on the event loop: their tokenizing is small next to the rest of a
# request's work there, and a hop to the tokenizer's thread and back would add to every request in the one
# process that serves them all. Larger ones go to the thread, so a long prompt never stalls the loop. (No
# run has timed the hop on its own; docs/benchmarks.md, serving, has the request path's figures.)
_INLINE_TOKENIZE_BYTES = 4096


def _longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most UTF-8 bytes one token spells, special tokens included; None unless the tokenizer is plain
    byte-level BPE, where a text's bytes are exactly its tokens' bytes (so bytes / this bounds its tokens)."""
    table = ByteTable.of(tokenizer)
    return None if table is None else max(map(len, table.token_bytes))


def _local_path(name: str, field: str) -> str:
    """An existing directory as an absolute path (replicas may start elsewhere); a hub name or 'byte' as given."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        where = ""
        if not path.is_absolute() and _in_ray_worker():
            # `serve deploy` and `serve run <config>` build the app in a task on the cluster, not in the
            # shell the user typed the path in: say so, since the path may well exist there.
            where = (
                f" (a relative path is resolved where the app is built: here, on the cluster, in {Path.cwd()}; "
                "give an absolute path that every node can read, or use `serve run "
                "gpt2_platform.serve.app:build_app model=...`, which resolves it where you type it)"
            )
        raise ValueError(
            f"{field} directory {name!r} does not exist{where}; `make demo` exports runs/demo-tiny/model, "
            f"or set args.{field} to a Hugging Face model directory or hub name"
        )
    return name


@serve.deployment(health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(app)
class GPT2Server:
    """One ingress replica: the HTTP routes, in front of the engine deployment.

    No @serve.batch: the engine batches continuously. A request joins the running
    batch at the next decode step and leaves at the step it finishes; @serve.batch
    would instead gather requests into a batch and run it to the end, so a short
    request would wait for the longest one in its batch.
    """

    def __init__(
        self, args: schemas.AppArgs, moderator: Moderator | None = None, engine: DeploymentHandle | None = None
    ) -> None:
        self.args, self.limits, self.model_name = args, args.limits, args.model_name
        self.moderator = moderator  # built once by the app builder from args.moderation
        self.api_key = errors.read_api_key(args.api_key_env)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        # One thread, so the tokenizer (not safe to call from two threads at once) never is; large
        # prompts tokenize there and the event loop keeps serving the others meanwhile.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpt2-tokenize")
        self._max_token_bytes = _longest_token_bytes(self.tokenizer)
        if engine is None:
            raise ValueError("GPT2Server needs the engine deployment's handle: build the app with build_app")
        model_config = checkpoint.read_config(checkpoint.resolve(args.model, allow_patterns=[checkpoint.CONFIG_NAME]))
        self.engine = RemoteEngine(
            engine,
            self.tokenizer,
            max_seq_len=args.engine.max_seq_len or model_config.n_positions,
            vocab_size=model_config.vocab_size,
            admission=lambda: Admission(self.limits.max_waiting, self.limits.max_queue_wait_s),
        )
        self.metrics = ServeMetrics(self.model_name)
        self._bodies_in_flight = 0  # requests whose bodies are still arriving (autoscaling leaves them out)
        self.created = schemas.now_s()
        # What this replica holds by now lives as long as it does: keep it out of every full collection's
        # walk (gc_pauses.py), and count the collections that come after.
        gc_pauses.settle()
        self.gc_pauses = gc_pauses.GcPauses()
        logger.info("serving %s from %s (engine %s)", self.model_name, args.model, args.engine)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Live limits: the deployment's `user_config`, key by key over the builder's `limits`."""
        try:
            self.limits = schemas.ServeLimits.model_validate({**self.args.limits.model_dump(), **user_config})
        except ValidationError as error:
            raise ValueError(f"invalid user_config for {type(self).__name__}: {error}") from None
        logger.info("limits: %s", self.limits)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this for the autoscaling policy (serve/autoscaling.py): bodies still being read."""
        return {BODIES_IN_FLIGHT: float(self._bodies_in_flight)}

    def check_health(self) -> None:
        """Serve calls this periodically. Only this replica's own parts count: an engine that failed is
        the engine deployment's to replace, and this replica answers 503 meanwhile."""
        if not self.engine.inlet.alive():
            raise RuntimeError("this replica's token link stopped accepting engines")

    def __del__(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.stop()
        if hasattr(self, "engine"):
            self.engine.shutdown()
        if hasattr(self, "gc_pauses"):
            self.gc_pauses.close()
        if hasattr(self, "_tokenize_pool"):
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- routes --------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._respond("completions", request, self._completions)

    @app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._respond("generate", request, self._generate)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._respond("models", request, self._models)

    # `:path`: a served name may hold slashes (openai-community/gpt2), as OpenAI's client sends it.
    @app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        return await self._respond("model", request, lambda request: self._model(model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._respond("chat_completions", request, self._no_chat)

    @app.get("/v1/engine/stats")
    async def engine_stats(self, request: Request) -> Response:
        return await self._respond("engine_stats", request, self._engine_stats)

    @app.get("/health")
    async def health(self) -> Response:
        try:
            self.engine.check_health()
        except EngineDeadError as error:
            return APIError(503, str(error), errors.SERVER_ERROR).response()
        return JSONResponse({"status": "ok", "model": self.model_name})

    # ---- request handling ----------------------------------------------------------------------
    async def _respond(
        self, route: str, request: Request, handler: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Authenticate, run the handler, turn errors into OpenAI-style bodies, count the status."""
        try:
            errors.authorize(request.headers.get("authorization"), self.api_key)
            response = await handler(request)
        except APIError as error:
            response = error.response()
        except EngineDeadError as error:
            message = f"{error}; retry the request"
            response = errors.unavailable(message, _ENGINE_DEAD_RETRY_AFTER_S, "engine_failed").response()
        except asyncio.CancelledError:
            self.metrics.record_request(route, 499)  # the client went away
            raise
        except Exception:
            self.metrics.record_request(route, 500)
            raise
        self.metrics.record_request(route, response.status_code)
        return response

    async def _read_body(self, request: Request, schema: type[schemas.Schema]) -> schemas.Schema:
        self._bodies_in_flight += 1
        try:
            return await schemas.read_json(request, schema, self.limits)
        finally:
            self._bodies_in_flight -= 1

    async def _completions(self, request: Request) -> Response:
        body = await self._read_body(request, schemas.CompletionRequest)
        body.check(self.limits, self.model_name)
        reserve = self._max_tokens(body)
        prompts = [await self._encode(p, "prompt", reserve) if isinstance(p, str) else p for p in body.prompt_list()]
        jobs = [Job(prompt, self._completion_params(body, i)) for prompt in prompts for i in range(body.n)]
        # Each choice's prompt as text (as given, or what its token ids spell): echo puts it before the
        # completion, and logprobs count their text offsets from it.
        shown = None
        if body.echo or body.logprobs is not None:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in body.prompt_list()]
            shown = [ShownPrompt(texts[i // body.n], jobs[i].prompt, body.echo) for i in range(len(jobs))]
        for job in jobs:
            self._validate(job, length_param="max_tokens")
        await self._check_prompts(body.prompt_list())
        choices = await self._admit(jobs, incremental_text=body.stream)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", schemas.now_s()
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(
                choices, request_id, created, prompt_tokens if include_usage else None, body.logprobs, shown
            )
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        outputs, completion_tokens = await self._collect(choices, len(jobs), body.logprobs, shown)
        usage = schemas.usage(prompt_tokens, completion_tokens)
        return JSONResponse(schemas.completion(request_id, created, self.model_name, outputs, usage))

    async def _generate(self, request: Request) -> Response:
        started_at = time.perf_counter()
        body = await self._read_body(request, schemas.GenerateRequest)
        prompt = await self._encode(body.prompt, "prompt", 1, length_param="max_length")
        max_tokens = body.max_length - len(prompt)
        if max_tokens < 1:
            raise bad_request(
                f"max_length ({body.max_length}) counts the prompt too and must exceed its {len(prompt)} tokens",
                "max_length",
            )
        if max_tokens > self.limits.max_tokens_cap:
            raise bad_request(
                f"max_length allows {max_tokens} new tokens, over {self.limits.max_tokens_cap}", "max_length"
            )
        job = Job(prompt, GenerationParams(max_tokens, sampling=self._sampling(temperature=body.temperature)))
        self._validate(job, length_param="max_length")
        await self._check_prompts([body.prompt])
        outputs, _ = await self._collect(await self._admit([job], incremental_text=False), 1)
        text = body.prompt + outputs[0]["text"]
        response = {"generated_text": text, "inference_time": time.perf_counter() - started_at}
        if outputs[0]["finish_reason"] == CONTENT_FILTER:  # the continuation was withheld
            response["finish_reason"] = CONTENT_FILTER
        response["seed"] = outputs[0].get("seed")
        return JSONResponse(response)

    async def _models(self, request: Request) -> Response:
        return JSONResponse(schemas.model_list(self.model_name, self.created, self.engine.max_seq_len))

    async def _model(self, model_id: str) -> Response:
        if model_id != self.model_name:
            message = f"model {model_id!r} is not served here; this server serves {self.model_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        return JSONResponse(schemas.model_card(self.model_name, self.created, self.engine.max_seq_len))

    async def _no_chat(self, request: Request) -> Response:
        # 404, not 400: no body could make this route work here, and OpenAI's client reads a 404 as
        # "this model/endpoint does not exist" (NotFoundError) rather than "fix your request".
        raise APIError(
            404,
            f"model {self.model_name!r} has no chat template, so this server has no /v1/chat/completions; "
            "send the text to continue as `prompt` to POST /v1/completions",
            code="chat_not_supported",
        )

    async def _engine_stats(self, request: Request) -> Response:
        """One engine replica's counters (Serve picks which), and this ingress replica's own."""
        context = serve.get_replica_context()
        ingress = {
            "replica": context.replica_id.unique_id if context is not None else None,
            "pid": os.getpid(),
            **self.engine.stats(),
            **self.gc_pauses.stats(),
        }
        return JSONResponse({**await self.engine.engine_stats(), "ingress": ingress})

    # ---- turning a request into engine work ----------------------------------------------------
    async def _encode(self, text: str, param: str, reserve: int, length_param: str = "max_tokens") -> list[int]:
        """The text's token ids; 400 before tokenizing a text too long for the context whatever its tokens.

        `reserve`: the tokens the request needs after the prompt (they shrink the room for it).
        """
        if not text:
            raise bad_request(f"{param} is empty; send at least one character", param)
        try:
            num_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") is valid JSON but not text
            raise bad_request(f"{param} is not valid Unicode text (it holds a lone surrogate)", param) from None
        room = self.engine.max_seq_len - reserve
        if self._max_token_bytes is not None and num_bytes > max(room, 0) * self._max_token_bytes:
            # No token spells more than _max_token_bytes bytes, so this text needs more than `room` tokens.
            raise bad_request(
                f"{param} is {num_bytes} bytes, more than the {max(room, 0)} tokens left of this model's "
                f"{self.engine.max_seq_len}-token context can hold (at most {self._max_token_bytes} bytes a "
                f"token); shorten the prompt or lower {length_param}",
                length_param,
                "context_length_exceeded",
            )
        if num_bytes <= _INLINE_TOKENIZE_BYTES:
            return self._tokenize(text)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._tokenize, text)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _max_tokens(self, body: schemas.CompletionRequest) -> int:
        return self.limits.default_max_tokens if body.max_tokens is None else body.max_tokens

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprobs_body(
        self, echo: ShownPrompt | None, logprobs: list[tuple[int, Any]], prompt_logprobs: list | None, offset: int
    ) -> dict[str, list]:
        """A choice's (or a chunk's) OpenAI logprobs object: the echoed prompt's tokens first, if given."""
        tokens = [token for token, _ in logprobs]
        entries = [entry for _, entry in logprobs]
        if echo is not None:
            tokens = echo.tokens + tokens
            entries = (prompt_logprobs or [None] * len(echo.tokens)) + entries
        return schemas.logprobs(tokens, entries, offset, self._token_text)

    def _completion_params(self, body: schemas.CompletionRequest, choice_index: int) -> GenerationParams:
        # Choice i of a seeded request uses seed + i: distinct choices, reproducible as a whole.
        seed = None if body.seed is None else body.seed + choice_index
        if seed is not None and seed > schemas.MAX_INT64:
            raise bad_request(f"seed + n - 1 must stay below 2**63, got seed={body.seed}, n={body.n}", "seed")
        return GenerationParams(
            max_tokens=self._max_tokens(body),
            stop=tuple(body.stop_strings()),
            ignore_eos=body.ignore_eos,
            sampling=self._sampling(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=seed),
            logprobs=body.logprobs,
            echo=body.echo,
        )

    @staticmethod
    def _sampling(**values: Any) -> SamplingParams:
        try:
            return SamplingParams(**values)
        except ValueError as error:  # the engine's message starts with the field it refused
            message = str(error)
            raise bad_request(message, next((f for f in _SAMPLING_FIELDS if message.startswith(f)), None)) from None

    def _validate(self, job: Job, length_param: str) -> None:
        """400 for what the engine cannot run; the common cases get OpenAI's param and code."""
        if not job.prompt:
            raise bad_request("prompt is empty; send at least one token", "prompt")
        total, context = len(job.prompt) + job.params.max_tokens, self.engine.max_seq_len
        if scoring_only(job.params) and total > context + 1:
            raise bad_request(
                f"this model's context is {context} tokens; a scored prompt (echo, max_tokens 0) may hold "
                f"{context + 1}, the last one scored only, but this one has {total}; shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        if not scoring_only(job.params) and total > context:
            raise bad_request(
                f"this model's context is {context} tokens, but the request needs {total} "
                f"({len(job.prompt)} in the prompt, {job.params.max_tokens} to generate); "
                f"shorten the prompt or lower {length_param}",
                length_param,
                "context_length_exceeded",
            )
        try:
            self.engine.validate(job.prompt, job.params)
        except ValueError as error:
            raise bad_request(str(error), "prompt" if "prompt" in str(error) else None) from None

    async def _moderate(self, check: Callable[..., Any], *texts: Any) -> Any:
        """Run a moderation check; one that calls the user's function runs off the event loop (it may be slow)."""
        assert self.moderator is not None
        return await asyncio.to_thread(check, *texts) if self.moderator.calls_user_code else check(*texts)

    async def _check_prompts(self, prompts: list[str | list[int]]) -> None:
        """400 content_policy_violation for a prompt moderation blocks, before it takes an engine slot."""
        if self.moderator is None or not self.moderator.checks_prompts:
            return
        for index, prompt in enumerate(prompts):
            # Token-id prompts are checked as the text they spell, so they are no way around the check.
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
            verdict: Verdict | None = await self._moderate(self.moderator.check_prompt, text)
            if verdict is not None:
                self.metrics.record_moderation_block("prompt")
                which = "the prompt" if len(prompts) == 1 else f"prompt {index}"
                raise errors.content_policy_violation(
                    f"{which} was refused by this server's content policy ({verdict.reason})"
                )

    async def _admit(self, jobs: list[Job], incremental_text: bool = True) -> Choices:
        """Submit the jobs and wait until each has its first event: a token, or the engine's refusal.

        An engine with every slot busy takes a request while it should start within limits.max_queue_wait_s
        at the rate slots have been freeing (and while fewer than limits.max_waiting wait); otherwise the
        request gets 429 at once, with the Retry-After the engine computed from that rate
        (engine/admission.py). A request larger than the whole bound still runs on an idle engine. Waiting
        for the first events before answering lets a refusal or a failed engine still be a status code.
        """
        choices = Choices(self.engine, jobs, self.metrics, incremental_text)
        try:
            first = await choices.started()
        except BaseException:  # the client went away meanwhile
            choices.cancel()
            raise
        if first is None:
            return choices
        choices.cancel()
        if first.finish_reason == "refused":
            refusal = Refusal.parse(first.error or "") or Refusal(1, first.error or "")
            retry_after = refusal.retry_after_s
            raise APIError(
                429,
                f"the server is busy: {refusal.message}; retry in {retry_after} s",
                errors.RATE_LIMIT,
                code="overloaded",
                headers={"Retry-After": str(retry_after)},
            )
        raise _engine_failed(first)

    async def _collect(
        self,
        choices: Choices,
        num_choices: int,
        logprobs: int | None = None,
        shown: list[ShownPrompt] | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Every choice's full text and finish reason (with `logprobs`, its tokens' log-probabilities; with
        echo, its prompt first: `shown`), and the completion tokens of all of them."""
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        reasons: list[str | None] = [None] * num_choices
        seeds: list[int | None] = [None] * num_choices
        token_logprobs: list[list] = [[] for _ in range(num_choices)]
        prompt_logprobs: list[list | None] = [None] * num_choices
        completion_tokens = 0
        # No interval: this coroutine wakes for each choice's first token and its end, not per token.
        async with contextlib.aclosing(choices.updates(interval_s=math.inf)) as updates:
            async for batch in updates:
                for update in batch:
                    texts[update.index].append(update.text)
                    token_logprobs[update.index].extend(update.logprobs or ())
                    if update.prompt_logprobs is not None:
                        prompt_logprobs[update.index] = update.prompt_logprobs
                    end = update.end
                    if end is None:
                        continue
                    if end.finish_reason == "error":
                        raise _engine_failed(end)
                    reasons[update.index], seeds[update.index] = end.finish_reason, end.seed
                    completion_tokens += end.completion_tokens
        outputs = [schemas.choice(i, "".join(texts[i]), reasons[i], seeds[i]) for i in range(num_choices)]
        if self.moderator is not None and self.moderator.checks_completions:
            for output in outputs:
                if await self._moderate(self.moderator.check_completion, output["text"]) is not None:
                    self.metrics.record_moderation_block("completion")
                    output.update(text="", finish_reason=CONTENT_FILTER)  # withheld, as OpenAI does
                    token_logprobs[output["index"]] = []  # and so are its tokens
        for i, (output, prompt) in enumerate(zip(outputs, shown or (), strict=False)):
            if logprobs is not None:
                echo, offset = (prompt, 0) if prompt.echoed else (None, len(prompt.text))
                output["logprobs"] = self._logprobs_body(echo, token_logprobs[i], prompt_logprobs[i], offset)
            if prompt.echoed:
                output["text"] = prompt.text + output["text"]
        return outputs, completion_tokens

    async def _stream(
        self,
        choices: Choices,
        request_id: str,
        created: int,
        prompt_tokens: int | None,
        logprobs: int | None = None,
        shown: list[ShownPrompt] | None = None,
    ) -> AsyncIterator[str]:
        """SSE chunks, one per choice per update, then the usage (if asked for) and [DONE].

        A chunk carries all the text its choice made since the last one: a first token and an end
        go out at once, the rest at most every limits.stream_interval_ms (0: as soon as it comes).
        Each chunk costs this process a JSON encoding and a write, more host time than the token
        that made it, so packing tokens is what lets one ingress carry hundreds of streams.

        A client that disconnects makes Serve cancel this generator; closing `choices.updates()`
        then cancels the sequences, freeing their slots within a step.
        """
        completion_tokens = 0
        guards: dict[int, CompletionGuard] = {}
        filtered: set[int] = set()
        echoed: set[int] = set()  # choices whose prompt went out (in their first chunk)
        offsets: dict[int, int] = {}  # with logprobs: where each choice's next chunk starts in its text
        interval_s = self.limits.stream_interval_ms / 1000
        failed = None
        async with contextlib.aclosing(choices.updates(interval_s)) as updates:
            async for batch in updates:
                chunks = []
                for update in batch:
                    end = update.end
                    if end is not None and end.finish_reason == "error":
                        failed = end
                        break
                    if end is not None:
                        completion_tokens += end.completion_tokens
                    if update.index in filtered:
                        continue  # moderation stopped it: drop what its sequence sent before the cancel took effect
                    text, finish_reason = await self._moderate_delta(choices, guards, update)
                    if finish_reason == CONTENT_FILTER:
                        filtered.add(update.index)
                    prompt = shown[update.index] if shown is not None else None
                    echo = prompt if prompt is not None and prompt.echoed and update.index not in echoed else None
                    if echo is not None:  # the prompt goes out first, in the choice's first chunk
                        echoed.add(update.index)
                        text = echo.text + text
                    if text or finish_reason:
                        # The seed goes with the choice's last chunk (the one with its finish_reason).
                        seed = end.seed if finish_reason and end is not None else None
                        body = None
                        if logprobs is not None:
                            start = offsets.get(update.index, 0 if prompt.echoed else len(prompt.text))
                            tokens = [] if finish_reason == CONTENT_FILTER else update.logprobs or []
                            body = self._logprobs_body(echo, tokens, update.prompt_logprobs, start)
                            offsets[update.index] = start + sum(map(len, body["tokens"]))
                        output = schemas.choice(update.index, text, finish_reason, seed, body)
                        chunks.append(_sse(schemas.completion(request_id, created, self.model_name, [output], None)))
                if failed is not None:
                    chunks.append(_sse(_engine_failed(failed).body()))
                if chunks:
                    yield "".join(chunks)
                if failed is not None:
                    break
        if prompt_tokens is not None and failed is None:
            usage = schemas.usage(prompt_tokens, completion_tokens)
            yield _sse(schemas.completion(request_id, created, self.model_name, [], usage))
        yield _sse("[DONE]")

    async def _moderate_delta(
        self, choices: Choices, guards: dict[int, CompletionGuard], update: Update
    ) -> tuple[str, str | None]:
        """A streamed update as moderation lets it out: the text to send now, and the finish reason.

        A blocked choice ends with finish_reason content_filter and its sequence is cancelled, freeing its slot.
        """
        finish_reason = update.end.finish_reason if update.end is not None else None
        if self.moderator is None or not self.moderator.checks_completions:
            return update.text, finish_reason
        guard = guards.setdefault(update.index, CompletionGuard(self.moderator))
        text, verdict = await self._moderate(guard.feed, update.text, update.end is not None)
        if verdict is None:
            return text, finish_reason
        self.metrics.record_moderation_block("completion")
        if update.end is None:
            choices.cancel_one(update.index)
        return "", CONTENT_FILTER


def default_max_ongoing_requests(args: schemas.AppArgs) -> int:
    """Enough that Serve hands on what the engine could batch, the requests we refuse with 429 ourselves
    (in JSON, with Retry-After, where Serve's own queue-full 503 is plain text), and clients still
    sending their bodies (each holds a slot for up to limits.body_timeout_s): an idle request in a
    replica costs a coroutine, not engine work, which our own admission check bounds."""
    return max(1024, 2 * (args.engine.max_slots + args.limits.max_waiting))


def _in_ray_worker() -> bool:
    """True in a Ray worker: for `serve deploy` / `serve run <config>`, the builder runs as a task on the
    cluster, with the application's runtime_env and the node's environment, as the replicas will."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def _check_api_key_env(args: schemas.AppArgs, options: dict[str, Any]) -> None:
    """Refuse, before Serve touches a running deployment, an app whose replicas could not read their key.

    A replica refuses to start without it, but by then Serve has already begun replacing the running
    replicas with ones that never come up. Where this builder runs on the cluster, its environment is
    the replicas' (the node's plus the application's runtime_env env_vars); elsewhere (`serve run
    module:app` and Python) it may not be, so an unset key there is only a warning.
    """
    if args.api_key_env is None:
        return
    actor_env = ((options.get("ray_actor_options") or {}).get("runtime_env") or {}).get("env_vars") or {}
    if actor_env.get(args.api_key_env) or os.environ.get(args.api_key_env):
        return
    message = (
        f"args.api_key_env is {args.api_key_env!r}, but that environment variable is unset or empty where "
        "the app is built, so its replicas could not authenticate clients; export it on every node before "
        "`ray start` (or in the pods' env), or set it in the application's runtime_env: env_vars"
    )
    if _in_ray_worker():
        raise ValueError(message)
    logger.warning("%s (the replicas refuse to start unless their environment has it)", message)


def gpt2_deployment(
    args: schemas.AppArgs | dict[str, Any], engine_options: dict[str, Any] | None = None, **options: Any
) -> Application:
    """The application with Serve deployment options given from Python (what the YAML's `deployments:`
    sets): `options` for the ingress (GPT2Server), `engine_options` for the engine (GPT2Engine)."""
    if not isinstance(args, schemas.AppArgs):
        args = schemas.AppArgs.model_validate(args)
    _check_api_key_env(args, options)
    tokenizer = None if args.tokenizer is None else _local_path(args.tokenizer, "tokenizer")
    # The served name defaults to the model as the user wrote it, not to the resolved path.
    update = {"model": _local_path(args.model, "model"), "tokenizer": tokenizer, "served_model_name": args.model_name}
    args = args.model_copy(update=update)
    _check_checkpoint(args.model)
    options.setdefault("max_ongoing_requests", default_max_ongoing_requests(args))
    options.setdefault("user_config", args.limits.model_dump())
    engine_options = dict(engine_options or {})
    # Each sequence is one call that lasts as long as it runs: room for every sequence an engine may hold
    # before it refuses more itself (429 JSON, where Serve's own queue-full 503 is plain text).
    engine_options.setdefault("max_ongoing_requests", default_max_ongoing_requests(args))
    # One call per sequence: a log line each would cost the engine's replica more than the call. The
    # ingress's access log still has every HTTP request.
    engine_options.setdefault("logging_config", {"enable_access_log": False})
    # Read the blocklist and import the callable here, once: a mistake stops `serve run` before any replica starts.
    moderator = build_moderator(args.moderation)
    engine = GPT2Engine.options(**engine_options).bind(
        args.model, args.tokenizer or args.model, args.engine, args.model_name, args.gpu_monitor
    )
    return GPT2Server.options(**options).bind(args, moderator, engine)


def _check_checkpoint(model: str) -> None:
    """Refuse, in the builder, a local checkpoint whose config.json this model cannot honour: before Serve
    touches a running deployment, rather than in each replica that would fail to start. (A hub name is
    checked by the replica that downloads it.)"""
    directory = Path(model)
    if (directory / checkpoint.CONFIG_NAME).is_file():
        checkpoint.read_config(directory)


def build_app(args: schemas.AppArgs) -> Application:
    """The app builder `deployments/gpt2.yaml` names: Serve validates `args:` against AppArgs first."""
    return gpt2_deployment(args)
