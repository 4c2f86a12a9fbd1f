"""The completions logic behind the HTTP routes: a read body -> engine jobs -> events -> a JSON body or SSE.

`CompletionServing` does the work of POST /v1/completions and POST /generate for one ingress replica
(serve/app.py routes them here, after authenticating and reading the body): tokenizing, the checks the
engine would otherwise fail on, moderation, admission, then the choices collected into one response or
streamed as SSE, with logprobs, echo, n and stop strings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from gpt2_platform.engine.admission import Refusal
from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.requests import Event, GenerationParams, scoring_only
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.moderation import CONTENT_FILTER, CompletionGuard, Moderator, Verdict
from gpt2_platform.serve import errors, schemas
from gpt2_platform.serve.engine_client import RemoteEngine
from gpt2_platform.serve.errors import APIError, bad_request
from gpt2_platform.serve.metrics import ServeMetrics
from gpt2_platform.serve.streams import Choices, Job, ShownPrompt, Update

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# The Retry-After of a 503 when the engine died: about the time Serve takes to notice (the engine's
# health_check_period_s) and start a replacement replica of a small model.
ENGINE_DEAD_RETRY_AFTER_S = 5


def engine_unavailable(message: str) -> APIError:
    """The 503 for a request the engine could not run (it died or failed): another try may reach a live one."""
    return errors.unavailable(f"{message}; retry the request", ENGINE_DEAD_RETRY_AFTER_S, "engine_failed")


def _engine_failed(event: Event) -> APIError:
    return engine_unavailable(f"generation failed: {event.error}")


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


class CompletionServing:
    """The completions of one ingress replica: turns a read request body into engine jobs, and their events
    into the response. The replica (serve/app.py) keeps the HTTP side: authentication, bodies, status counts."""

    def __init__(
        self,
        engine: RemoteEngine,
        tokenizer: PreTrainedTokenizerBase,
        metrics: ServeMetrics,
        moderator: Moderator | None,
        model_name: str,
        limits: schemas.ServeLimits,
    ) -> None:
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.moderator, self.model_name = moderator, model_name
        self.limits = limits  # replaced whole by the replica's reconfigure
        # One thread, so the tokenizer (not safe to call from two threads at once) never is; large
        # prompts tokenize there and the event loop keeps serving the others meanwhile.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpt2-tokenize")
        self._max_token_bytes = _longest_token_bytes(tokenizer)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- the routes' work ----------------------------------------------------------------------
    async def create_completion(self, body: schemas.CompletionRequest) -> Response:
        """POST /v1/completions: one JSON body, or with `stream` an SSE response."""
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

    async def generate(self, body: schemas.GenerateRequest, started_at: float) -> Response:
        """POST /generate: the prompt and its continuation as one text; inference_time counts from `started_at`."""
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

    # ---- events to a response -----------------------------------------------------------------
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
                            assert prompt is not None  # with logprobs, create_completion shows every prompt
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
