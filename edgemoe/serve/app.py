"""The routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health.

Every request becomes a Job for the one engine thread (worker.py). A client that goes away
cancels its job: a streamed reply notices when the SSE stream is torn down, a whole reply
through a task that waits for the connection's http.disconnect.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..runtime.sampling import SamplingParams
from .errors import APIError, install_handlers
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, Kind, Reply
from .worker import EngineWorker, Job, Outcome, QueueFullError


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # what /v1/models lists and requests must name
    sampling: SamplingParams  # defaults for fields a request leaves out
    max_tokens: int  # reply length when a request gives none
    api_key: str | None = None


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _next(job: Job) -> tuple[str, Any]:
    kind, value = await job.events.get()
    if kind == "error":
        raise value
    return kind, value


class APIKeyMiddleware:
    """401 for /v1/ requests without `Authorization: Bearer KEY`, before their body is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not secrets.compare_digest(given, self.key):
                err = APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                               code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Routes:
    def __init__(self, worker: EngineWorker, config: ServerConfig) -> None:
        self.worker = worker
        self.config = config
        self.started = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_id, "object": "model", "created": self.started, "owned_by": "edgemoe"}

    def check_model(self, model: str) -> None:
        if model != self.config.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.model_id!r}", param="model", code="model_not_found")

    async def health(self) -> dict[str, Any]:
        w = self.worker
        return {"status": "ok", "model": self.config.model_id, "busy": w.busy, "queued": w.queued,
                "max_queue": w.max_queue, "served": w.served}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
        return self.model_card()

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        return await self._serve(request, body, "chat", messages=body.chat_messages())

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        return await self._serve(request, body, "text", prompt=body.text())

    async def _serve(self, request: Request, body: GenerationRequest, kind: Kind, **what: Any) -> Any:
        body.check()
        job = Job(asyncio.get_running_loop(), body.limit(self.config.max_tokens),
                  body.sampling(self.config.sampling), body.stops(), **what)
        try:
            self.worker.submit(job)
        except QueueFullError:
            raise APIError(503, f"the server is busy: {self.worker.max_queue} requests wait already; "
                                "retry later", code="queue_full") from None
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        reply = Reply(kind, self.config.model_id)
        try:
            await _next(job)  # "start": the prompt fits; errors before it are answered with a status
            if body.stream:
                watcher.cancel()  # from here StreamingResponse watches the connection
                return StreamingResponse(self._stream(job, reply, body.include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            parts: list[str] = []
            while True:
                event, value = await _next(job)
                if event == "delta":
                    parts.append(value)
                else:
                    return JSONResponse(reply.whole("".join(parts), value))
        finally:
            watcher.cancel()
            if not body.stream:
                job.cancel()  # no-op once done; stops the engine if this handler was cancelled

    async def _stream(self, job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        try:
            if reply.kind == "chat":
                yield _sse(reply.chunk(None, first=True))
            while True:
                try:
                    event, value = await _next(job)
                except APIError as err:  # after the headers: the error goes in the stream
                    yield _sse(err.body())
                    break
                if event == "delta":
                    yield _sse(reply.chunk(value))
                    continue
                out: Outcome = value
                yield _sse({**reply.chunk(None if reply.kind == "chat" else "", out.finish_reason),
                            "edgemoe": out.extension})
                if include_usage:
                    yield _sse(reply.usage_chunk(out))
                break
            yield _sse("[DONE]")
        finally:
            job.cancel()  # the client went away mid-stream (or we are done): free the engine


def create_app(worker: EngineWorker, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="edgemoe", summary="OpenAI-compatible API over one edgemoe Engine",
                  openapi_url=None, docs_url=None, redoc_url=None)
    install_handlers(app)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, key=config.api_key)
    r = Routes(worker, config)
    app.add_api_route("/health", r.health, methods=["GET"])
    app.add_api_route("/v1/models", r.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", r.model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", r.chat, methods=["POST"])
    app.add_api_route("/v1/completions", r.completions, methods=["POST"])
    return app
