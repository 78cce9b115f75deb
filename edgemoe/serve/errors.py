"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with a fitting status."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error answered to the client as one JSON error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - the field's name in the API
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_validation(exc: RequestValidationError) -> APIError:
    """The first problem of a request body that did not parse or validate, as a 400."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}",
                        code="json_invalid")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return APIError(400, "the request body must be a JSON object (send Content-Type: application/json)",
                        code="invalid_body")
    msg = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else f"the request body is invalid: {msg}", param=param,
                    code="missing_field" if first.get("type") == "missing" else "invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Answer every error (ours, validation, routing, unexpected) in the OpenAI shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation(exc).response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, str(exc.detail)).response()

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
