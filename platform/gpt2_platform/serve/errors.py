"""OpenAI-style errors: one exception type, one JSON shape, handlers that map FastAPI's own errors to it,
and the API key check (the one error raised before a request is read).

Every error the server sends looks like
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, whatever
raised it: our checks, pydantic, FastAPI's routing (404/405), or a request
FastAPI itself failed to validate (400, never its default 422 shape).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error to send to the client as OpenAI does: a status, a message and what it was about."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def request_timeout(message: str) -> APIError:
    """The 408 for a body that did not arrive in time; the connection closes (its unread rest is garbage)."""
    return APIError(408, message, INVALID_REQUEST, code="request_timeout", headers={"Connection": "close"})


# nginx's code for "client closed request": no client reads it, but the metrics count it apart from errors.
CLIENT_CLOSED = 499


def client_closed(message: str) -> APIError:
    return APIError(CLIENT_CLOSED, message, INVALID_REQUEST, code="client_closed_request")


def unavailable(message: str, retry_after_s: int, code: str | None = None) -> APIError:
    """A 503 that tells the client when to try again (the engine died, the replica is being replaced)."""
    return APIError(503, message, SERVER_ERROR, code=code, headers={"Retry-After": str(retry_after_s)})


def content_policy_violation(message: str, param: str = "prompt") -> APIError:
    """The 400 for input that moderation blocked, with OpenAI's code for it."""
    return APIError(400, message, INVALID_REQUEST, param, "content_policy_violation")


def _field_path(error: dict[str, Any], skip_loc_prefix: tuple[str, ...]) -> list[str]:
    path = [str(part) for part in error.get("loc", ())]
    while path and path[0] in skip_loc_prefix:
        path.pop(0)  # FastAPI prefixes "body" / "query" / "path"
    return path


def from_validation_errors(errors: list[dict[str, Any]], skip_loc_prefix: tuple[str, ...] = ()) -> APIError:
    """A 400 naming the first field pydantic refused (loc ('temperature',) -> param 'temperature')."""
    if not errors:
        return bad_request("the request is invalid")
    paths = [_field_path(error, skip_loc_prefix) for error in errors]
    first, path = errors[0], paths[0]
    param = path[0] if path else None
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unknown field {param!r}; this server does not support it", param, "unknown_field")
    if sum(other[:1] == path[:1] for other in paths) > 1:
        # A union type: pydantic reports each alternative it tried; the first one's message is enough.
        return bad_request(f"{param}: wrong type or value ({first['msg']})", param, "invalid_type")
    where = ".".join(path) or "body"
    return bad_request(f"{where}: {first['msg']}", param, "invalid_value")


def from_validation_error(error: ValidationError) -> APIError:
    return from_validation_errors(error.errors(include_url=False))


def install_handlers(app: FastAPI) -> None:
    """Map every error FastAPI or Starlette could raise to the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(error.errors()), skip_loc_prefix=("body", "query", "path")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if error.status_code < 500 else SERVER_ERROR
        api_error = APIError(error.status_code, str(error.detail), kind, headers=error.headers)
        return api_error.response()


def read_api_key(env_name: str | None) -> str | None:
    """The key from the named environment variable; a named but unset variable is an error, not 'no auth'."""
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if not key:
        raise ValueError(f"api_key_env is {env_name!r}, but that environment variable is unset or empty on the replica")
    return key


def authorize(authorization: str | None, api_key: str | None) -> None:
    """Raise 401 unless the Authorization header is `Bearer <api_key>` (compared in constant time)."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
            AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
