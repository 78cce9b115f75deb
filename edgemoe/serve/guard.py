"""The guard in front of the routes: API keys, and request bodies held to a size, a time and a budget.

On /v1/: 401 without one of the API keys; 413 for a body over the limit, announced or counted as it arrives,
chunked or not; 408 for a body that has not arrived within the read timeout; 503 (Anthropic: 529) when the
bodies arriving on all connections together hold more than the bodies' budget; 400 for a body nesting JSON
deeper than limits.MAX_JSON_DEPTH. The body is read here, whole, and handed on. (A body framed by both
`Content-Length` and `Transfer-Encoding` never gets here: front.py refuses it on every path.) On /health a
valid key names the request's scope (what /health may show), a missing one is no error.

A key is accepted as `Authorization: Bearer KEY` or `x-api-key: KEY`; when a request carries both, one
valid key is enough (a stale token in one header does not hide a good key in the other).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, is_anthropic
from .limits import BodyBudget, check_body_depth

SCOPE_KEY = "edgemoe.scope"  # the ASGI scope entry naming the request's API key (its prompt-cache scope)


def key_scope(key: str) -> str:
    """The prompt-cache scope of an API key (its digest: the key itself is not kept around)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class BodyRefused(Exception):
    """A request body the guard answers itself (413, 408)."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, keys: tuple[str, ...], max_body: int, read_timeout_s: float, budget: BodyBudget
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s
        self.budget = budget  # shared by all connections

    def _key(self, headers: dict[bytes, bytes]) -> bytes | None:
        """The valid key among those the request carries, or None."""
        auth = headers.get(b"authorization", b"")
        given = [headers.get(b"x-api-key", b"").strip()]
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        # compare with every key (no early exit: the time taken does not tell which one is near)
        match = [k for k in self.keys for g in given if secrets.compare_digest(g, k)]
        return match[0] if match else None

    def _scope(self, headers: dict[bytes, bytes]) -> str | None:
        """The request's prompt-cache scope: "" on a server without keys, None without a valid key."""
        if not self.keys:
            return ""
        key = self._key(headers)
        return None if key is None else key_scope(key.decode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = dict(scope["headers"])
        owner = self._scope(headers)
        if owner is not None:
            scope[SCOPE_KEY] = owner
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if owner is None:
            how = "x-api-key: KEY" if is_anthropic(path) else "Authorization: Bearer KEY"
            error = APIError(401, f"invalid or missing API key (send {how})", code="invalid_api_key")
            await error.response(path)(scope, receive, send)
            return
        try:
            self._check_length(headers)
            body = await self._read_body(receive)
            if body is not None:
                check_body_depth(body)
        except APIError as error:  # the body was read whole: the connection can go on
            await error.response(path)(scope, receive, send)
            return
        except BodyRefused as refused:
            response = refused.error.response(path)
            response.headers["Connection"] = "close"  # the rest of the body is never read
            await response(scope, receive, send)
            return
        if body is None:  # the client left
            return
        first: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Message:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    def _check_length(self, headers: dict[bytes, bytes]) -> None:
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise BodyRefused(self._too_large())

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, counted as it arrives (against the limit and the bodies' budget); None when the
        client leaves first."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.read_timeout_s
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyRefused(self._too_slow()) from None
                if message["type"] != "http.request":
                    return None
                chunk = message.get("body", b"")
                if not self.budget.take(len(chunk)):
                    raise BodyRefused(self._over_budget())
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_body:
                    raise BodyRefused(self._too_large())
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.budget.give(size)  # read whole (or refused): no longer in flight

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than {self.max_body >> 20} MiB; send less (or "
            "start the server with a larger body limit, `max_body_mib`)",
            code="request_too_large",
        )

    def _over_budget(self) -> APIError:
        return APIError(
            503,
            f"the server holds {self.budget.capacity >> 20} MiB of request bodies arriving already; retry "
            "later (or start the server with a larger `max_bodies_mib`)",
            code="server_busy",
        )

    def _too_slow(self) -> APIError:
        return APIError(
            408,
            f"the request body did not arrive within {self.read_timeout_s:g} s; send it whole (or start "
            "the server with a longer `read_timeout_s`)",
            code="request_timeout",
        )
