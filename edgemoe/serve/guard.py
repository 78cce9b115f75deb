"""The guard in front of the routes: API keys, and request bodies held to a size and a time.

On /v1/: 401 without one of the API keys; 400 for a body framed by both `Content-Length` and
`Transfer-Encoding` (RFC 9112 §6.3: the HTTP server would trust one, a check of the other proves nothing);
413 for a body over the limit, announced or counted as it arrives, chunked or not; 408 for a body that has
not arrived within the read timeout. The body is read here, whole, and handed on. On /health a valid key
names the request's scope (what /health may show), a missing one is no error.

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
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], max_body: int, read_timeout_s: float) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s

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
            self._check_framing(headers)
            body = await self._read_body(receive)
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

    def _check_framing(self, headers: dict[bytes, bytes]) -> None:
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" in headers:
            raise BodyRefused(
                APIError(
                    400,
                    "the request has both Content-Length and Transfer-Encoding; send one of them",
                    code="invalid_framing",
                )
            )
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise BodyRefused(self._too_large())

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, counted as it arrives; None when the client leaves first."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise BodyRefused(self._too_slow()) from None
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                raise BodyRefused(self._too_large())
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than {self.max_body >> 20} MiB; send less (or "
            "start the server with a larger body limit, `max_body_mib`)",
            code="request_too_large",
        )

    def _too_slow(self) -> APIError:
        return APIError(
            408,
            f"the request body did not arrive within {self.read_timeout_s:g} s; send it whole (or start "
            "the server with a longer `read_timeout_s`)",
            code="request_timeout",
        )
