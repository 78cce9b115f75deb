"""Errors in each API's own shape, with a fitting status.

OpenAI (every path but /v1/messages): {"error": {"message", "type", "param", "code"}};
Anthropic (/v1/messages...): {"type": "error", "error": {"type", "message"}}, and 529 where OpenAI's is 503.
A message quotes a client's value through echo() (cut to ECHO_CHARS), and no message or param is ever longer
than MAX_MESSAGE_CHARS: an error never sends a client's megabytes back.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    503: "server_overloaded",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
RETRY_AFTER_S = 2  # what a 503 / 529 asks a client to wait before it retries
ECHO_CHARS = 80  # of a client's value quoted in a message
MAX_MESSAGE_CHARS = 1000  # of a message (and a param), whatever it quotes


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value as a message quotes it: its repr, cut to `limit` characters and then saying how long
    it was."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _capped(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "... (cut)"


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: a lone surrogate echoed back cannot break the encoding."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def is_anthropic(path: str) -> bool:
    """Is this path of the Anthropic Messages API (its errors take Anthropic's shape)?"""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """An error answered to the client as one JSON error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:  # noqa: A002 - the field's name in the API
        message = _capped(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _capped(param)
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.extra_headers: dict[str, str] = {}  # e.g. a 405's Allow

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer", **self.extra_headers}
        if self.status == 503:
            return {"Retry-After": str(RETRY_AFTER_S), **self.extra_headers}
        return dict(self.extra_headers)

    def response(self, path: str = "") -> JSONResponse:
        """The JSON response, in the shape of the API that path belongs to."""
        if is_anthropic(path):
            status = 529 if self.status == 503 else self.status
            return SafeJSONResponse(self.anthropic_body(), status_code=status, headers=self.headers())
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers())


class ContextOverflow(APIError):
    """A prompt the context cannot hold. Anthropic's clients read its numbers from Anthropic's own wording
    (Claude Code then stops retrying and says "prompt is too long"), so the Messages API gets that."""

    def __init__(self, message: str, *, prompt_tokens: int, n_ctx: int, param: str) -> None:
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx

    def anthropic_body(self) -> dict[str, Any]:
        # the longest prompt that fits leaves room for one token of reply
        text = f"prompt is too long: {self.prompt_tokens} tokens > {self.n_ctx - 1} maximum"
        return {"type": "error", "error": {"type": "invalid_request_error", "message": text}}


def internal_error(exc: BaseException) -> APIError:
    """A 500 that names an incident id, never the exception's text; the traceback goes to the log."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s while serving a request", incident, exc_info=exc)
    return APIError(500, f"internal server error (incident {incident}; the server log has the details)")


def from_validation(exc: RequestValidationError) -> APIError:
    """The first problem of a request body that did not parse or validate, as a 400."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {first.get('msg', '')}", code="json_invalid"
        )
    if first.get("type") == "lone_surrogate":  # checks.refuse_lone_surrogates
        param = str(first.get("ctx", {}).get("param", "")) or None
        return APIError(400, first.get("msg", "invalid text"), param=param, code="invalid_unicode")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return APIError(
            400,
            "the request body must be a JSON object (send Content-Type: application/json)",
            code="invalid_body",
        )
    msg = first.get("msg", "invalid request")
    return APIError(
        400,
        f"{param}: {msg}" if param else f"the request body is invalid: {msg}",
        param=param,
        code="missing_field" if first.get("type") == "missing" else "invalid_value",
    )


def install_handlers(app: FastAPI) -> None:
    """Answer every error (ours, validation, routing, unexpected) in the shape of the request's API."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response(request.url.path)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation(exc).response(request.url.path)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        error = APIError(exc.status_code, str(exc.detail))
        error.extra_headers = dict(exc.headers or {})  # a 405's Allow
        return error.response(request.url.path)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response(request.url.path)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
