"""OpenAI-shaped answers for what Serve's own HTTP proxy says, where a replica cannot say anything.

The replica answers every error it raises in OpenAI's JSON (serve/errors.py). Serve's proxy, in
front of it, answers a few things itself, as plain text: 503 when its queue is full
(max_queued_requests), 408 for its request_timeout_s, 404 for a path no app has, and a bare 500 or
a cut connection when the replica holding a request dies. This ASGI middleware runs in the proxy
and turns those into what an OpenAI client can read:

- a plain-text error (Serve's own, or Starlette's 500 for an exception in the app) becomes
  `{"error": {...}}` with the same status and Retry-After;
- a request whose replica died before answering gets JSON 503 with Retry-After;
- a stream cut because its replica died ends with an SSE error event in OpenAI's shape and
  `data: [DONE]`, instead of a connection closed mid-body.

Serve loads proxy middlewares from an environment variable read when the proxy starts, so it must
be set before `ray start` on every node (or before a local `serve run`), and the package must be
importable in the proxy's Python (start the cluster from the project's venv):

    export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=gpt2_platform.serve.proxy:middlewares

With direct or HAProxy ingress there is no Python proxy and this does not run.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpt2_platform.serve.errors import INVALID_REQUEST, SERVER_ERROR, APIError

logger = logging.getLogger(__name__)

# About the time Serve takes to notice a dead replica and start another one of a small model.
RETRY_AFTER_S = 10
_REPLICA_DIED = "the replica serving this request stopped before it finished; retry the request"


def middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: Serve calls it once in each proxy."""
    return [Middleware(OpenAIErrorsMiddleware)]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in headers if key.lower() == name), "")


class OpenAIErrorsMiddleware:
    """Rewrites Serve's own plain-text errors as OpenAI JSON and finishes responses a dead replica left open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _Response(send)
        try:
            await self.app(scope, receive, response.send)
        finally:
            await response.finish()


class _Response:
    """One response passing through: forwarded as it comes, except a plain-text error (held and rewritten)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.event_stream = False
        self._held: tuple[int, list[tuple[bytes, bytes]]] | None = None  # a plain-text error being rewritten
        self._held_body = bytearray()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            content_type = _header(headers, b"content-type")
            if message["status"] >= 400 and content_type.startswith("text/plain"):
                self._held = (message["status"], headers)  # Serve's own: our app only answers JSON
                return
            self.started = True
            self.event_stream = content_type.startswith("text/event-stream")
        elif message["type"] == "http.response.body":
            if self._held is not None:
                self._held_body += message.get("body", b"")
                if not message.get("more_body", False):
                    await self._send_rewritten()
                return
            if not message.get("more_body", False):
                self.finished = True
        await self._send(message)

    async def _send_rewritten(self) -> None:
        assert self._held is not None
        status, headers = self._held
        self._held = None
        text = self._held_body.decode("utf-8", errors="replace").strip() or f"HTTP {status}"
        kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
        if status == 500:  # an exception in the app (Starlette's "Internal Server Error"): the log has it
            text = "the server failed while answering this request; the error is in its log"
        keep = [(key, value) for key, value in headers if key.lower() == b"retry-after"]
        if status == 503 and not keep:
            keep = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        await self._send_json(APIError(status, text, kind), keep)

    async def _send_json(self, error: APIError, extra_headers: list[tuple[bytes, bytes]]) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        self.started = True
        await self._send(
            {"type": "http.response.start", "status": error.status_code, "headers": headers + extra_headers}
        )
        await self._send({"type": "http.response.body", "body": body})
        self.finished = True

    async def finish(self) -> None:
        """After the proxy is done with the request: end what it left unanswered or open."""
        if self.finished:
            return
        try:
            if self._held is not None:
                await self._send_rewritten()
            elif not self.started:
                error = APIError(503, _REPLICA_DIED, SERVER_ERROR, code="replica_failed")
                await self._send_json(error, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            elif self.event_stream:
                error = APIError(503, _REPLICA_DIED, SERVER_ERROR, code="replica_failed")
                tail = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
                await self._send({"type": "http.response.body", "body": tail, "more_body": False})
            else:  # a JSON body cut short: nothing a client can parse can be made of it; end it
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as error:  # the client is gone too, or the server refused: nothing more to do
            logger.info("could not finish a response its replica left open: %r", error)
        self.finished = True
