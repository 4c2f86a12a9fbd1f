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

This module is the router: each route authenticates, reads its body and hands it on. The completions
themselves are serve/completions.py's; the builder's checks and options are serve/builder.py's.
"""

# No `from __future__ import annotations` here: Serve converts a builder's args
# to its pydantic model only when the annotation is the class itself, not a string.

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from gpt2_platform import checkpoint, gc_pauses
from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.requests import EngineDeadError
from gpt2_platform.moderation import Moderator, build_moderator
from gpt2_platform.serve import builder, errors, schemas
from gpt2_platform.serve.autoscaling import BODIES_IN_FLIGHT
from gpt2_platform.serve.builder import default_max_ongoing_requests
from gpt2_platform.serve.completions import CompletionServing, engine_unavailable
from gpt2_platform.serve.engine_client import RemoteEngine
from gpt2_platform.serve.engine_deployment import GPT2Engine
from gpt2_platform.serve.errors import APIError
from gpt2_platform.serve.metrics import ServeMetrics
from gpt2_platform.tokenizer import load_tokenizer

# What the app's users (tests, jobs, probes) take from here; default_max_ongoing_requests is builder.py's.
__all__ = ["GPT2Engine", "GPT2Server", "app", "build_app", "default_max_ongoing_requests", "gpt2_deployment"]

logger = logging.getLogger(__name__)

app = FastAPI(title="gpt2-platform", docs_url=None, redoc_url=None)
errors.install_handlers(app)


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
        self.args, self.model_name = args, args.model_name
        self.api_key = errors.read_api_key(args.api_key_env)
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        if engine is None:
            raise ValueError("GPT2Server needs the engine deployment's handle: build the app with build_app")
        model_config = checkpoint.read_config(checkpoint.resolve(args.model, allow_patterns=[checkpoint.CONFIG_NAME]))
        self.engine = RemoteEngine(
            engine,
            tokenizer,
            max_seq_len=args.engine.max_seq_len or model_config.n_positions,
            vocab_size=model_config.vocab_size,
            admission=lambda: Admission(self.limits.max_waiting, self.limits.max_queue_wait_s),
        )
        self.metrics = ServeMetrics(self.model_name)
        # `moderator`: built once by the app builder from args.moderation.
        self.serving = CompletionServing(self.engine, tokenizer, self.metrics, moderator, self.model_name, args.limits)
        self._bodies_in_flight = 0  # requests whose bodies are still arriving (autoscaling leaves them out)
        self.created = schemas.now_s()
        # What this replica holds by now lives as long as it does: keep it out of every full collection's
        # walk (gc_pauses.py), and count the collections that come after.
        gc_pauses.settle()
        self.gc_pauses = gc_pauses.GcPauses()
        logger.info("serving %s from %s (engine %s)", self.model_name, args.model, args.engine)

    @property
    def limits(self) -> schemas.ServeLimits:
        """The live limits; the completions hold them, since nearly all of them bound a completion."""
        return self.serving.limits

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Live limits: the deployment's `user_config`, key by key over the builder's `limits`."""
        try:
            limits = schemas.ServeLimits.model_validate({**self.args.limits.model_dump(), **user_config})
        except ValidationError as error:
            raise ValueError(f"invalid user_config for {type(self).__name__}: {error}") from None
        self.serving.limits = limits
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
        if hasattr(self, "serving"):
            self.serving.close()

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
            response = engine_unavailable(str(error)).response()
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
        return await self.serving.create_completion(await self._read_body(request, schemas.CompletionRequest))

    async def _generate(self, request: Request) -> Response:
        started_at = time.perf_counter()  # the seed project's inference_time counts the body's reading too
        return await self.serving.generate(await self._read_body(request, schemas.GenerateRequest), started_at)

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


def gpt2_deployment(
    args: schemas.AppArgs | dict[str, Any], engine_options: dict[str, Any] | None = None, **options: Any
) -> Application:
    """The application with Serve deployment options given from Python (what the YAML's `deployments:`
    sets): `options` for the ingress (GPT2Server), `engine_options` for the engine (GPT2Engine)."""
    args = builder.resolve_args(args, options)
    options = builder.ingress_options(args, options)
    engine_options = builder.engine_options(args, engine_options)
    # Read the blocklist and import the callable here, once: a mistake stops `serve run` before any replica starts.
    moderator = build_moderator(args.moderation)
    # `@serve.deployment` made both classes Deployments; mypy reads a class decorator as leaving the class as
    # it was (python/mypy#3135), so it does not see `.options`
    engine = GPT2Engine.options(**engine_options).bind(  # type: ignore[attr-defined]
        args.model, args.tokenizer or args.model, args.engine, args.model_name, args.gpu_monitor
    )
    return GPT2Server.options(**options).bind(args, moderator, engine)  # type: ignore[attr-defined]


def build_app(args: schemas.AppArgs) -> Application:
    """The app builder `deployments/gpt2.yaml` names: Serve validates `args:` against AppArgs first."""
    return gpt2_deployment(args)
