"""The routes: GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/messages,
/v1/messages/count_tokens, /v1/responses, GET /health.

Every generation request becomes a Job for the one engine thread (worker.py). A client that goes away
cancels its job: a streamed reply notices when the SSE stream is torn down, a whole reply through a
task that waits for the connection's http.disconnect. While a streamed prompt is evaluated, pings
(an SSE comment for OpenAI, a `ping` event for Anthropic) keep clients from timing out.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.sampling import SamplingParams
from . import anthropic as ant
from .errors import APIError, echo, install_handlers
from .front import FrontMiddleware, HostPolicy
from .guard import SCOPE_KEY, GuardMiddleware
from .limits import BodyBudget
from .reasoning import Reasoning
from .responses import ResponseReply, ResponsesRequest
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, Reply
from .tools import ToolCall
from .transport import limit_accept_errors, widen_listen_queue
from .worker import SHUTTING_DOWN, EngineWorker, Job, Outcome, QueueFullError, ShuttingDownError


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # what /v1/models lists and requests must name
    sampling: SamplingParams  # defaults for fields a request leaves out
    max_tokens: int  # reply length when a request gives none
    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no key is asked
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    read_timeout_s: float = 600.0  # a request body must arrive within it (llama-server's default), else 408
    ping_s: float = 5.0  # a streamed reply's keep-alive interval while the prompt is evaluated
    count_concurrency: int = 1  # count_tokens requests tokenized at once (max_queue more may wait)
    # request bodies held at once while they arrive, on all connections; past it 503
    max_bodies_bytes: int = 64 << 20
    hosts: HostPolicy = HostPolicy()  # the Host values answered without api_keys (with keys: any)


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _next(job: Job, timeout: float | None = None) -> tuple[str, Any]:
    """The job's next event; ("ping", None) when none came within timeout seconds."""
    try:
        kind, value = await asyncio.wait_for(job.events.get(), timeout)
    except asyncio.TimeoutError:
        return "ping", None
    if kind == "error":
        raise value
    return kind, value


_STREAMED = ("ping", "delta", "reasoning", "tool_call")  # the events a stream goes on after


async def _stream_events(job: Job, ping_s: float) -> AsyncIterator[tuple[str, Any]]:
    """A running job's events for a streamed reply: ("ping", None) after `ping_s` seconds without one, "delta",
    "reasoning" and "tool_call" as they come, then the last: ("done", Outcome), or ("error", APIError) once the
    headers are sent. The caller cancels the job when its own stream ends (the client may leave mid-stream)."""
    while True:
        try:
            event, value = await _next(job, ping_s)
        except APIError as err:
            yield "error", err
            return
        yield event, value
        if event not in _STREAMED:
            return


def _busy(worker: EngineWorker) -> APIError:
    return APIError(
        503, f"the server is busy: {worker.max_queue} requests wait already; retry later", code="queue_full"
    )


class Gate:
    """At most `running` holders at once and `waiting` more waiting; beyond that QueueFullError."""

    def __init__(self, running: int, waiting: int) -> None:
        self._free = asyncio.Semaphore(running)
        self.max_waiting = waiting
        self.waiting = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._free.locked() and self.waiting >= self.max_waiting:
            raise QueueFullError
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._free.release()


class Routes:
    def __init__(self, worker: EngineWorker, config: ServerConfig) -> None:
        self.worker = worker
        self.config = config
        self.started = int(time.time())
        self.counting = Gate(config.count_concurrency, worker.max_queue)

    def model_card(self) -> dict[str, Any]:
        """One card both clients read: OpenAI's fields and Anthropic's."""
        created = datetime.fromtimestamp(self.started, timezone.utc).isoformat().replace("+00:00", "Z")
        return {
            "id": self.config.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "edgemoe",
            "type": "model",
            "display_name": self.config.model_id,
            "created_at": created,
        }

    def check_model(self, model: str) -> None:
        if model != self.config.model_id:
            raise APIError(
                404,
                f"the model {echo(model)} does not exist; this server serves {self.config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def health(self, request: Request) -> dict[str, Any]:
        """Without a valid key (when the server asks for one) only that the server is up; with one the queue
        and that key's prompt-cache figures."""
        scope = request.scope.get(SCOPE_KEY)
        if scope is None:
            return {"status": "ok"}
        w = self.worker
        out = {
            "status": "ok",
            "model": self.config.model_id,
            "busy": w.busy,
            "queued": w.queued,
            "max_queue": w.max_queue,
            "served": w.served,
        }
        if w.reuse.store is not None:
            out["prompt_cache"] = w.reuse.stats(scope)
        return out

    async def models(self) -> dict[str, Any]:
        card = self.model_card()
        return {
            "object": "list",
            "data": [card],
            "has_more": False,
            "first_id": card["id"],
            "last_id": card["id"],
        }

    async def model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
        return self.model_card()

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        body.check()
        job = self._job(
            request,
            body.limit(self.config.max_tokens),
            body.sampling(self.config.sampling),
            body.stops(),
            messages=body.chat_messages(),
            tools=body.template_tools(),
            speculate=body.speculate,
            constraint=body.constraint(),
            single_call=body.parallel_tool_calls is False,
            notes=body.notes(),
        )
        return await self._openai(request, job, Reply("chat", self.config.model_id), body)

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        body.check()
        job = self._job(
            request,
            body.limit(self.config.max_tokens),
            body.sampling(self.config.sampling),
            body.stops(),
            prompt=body.text(),
            speculate=body.speculate,
        )
        return await self._openai(request, job, Reply("text", self.config.model_id), body)

    async def messages(self, body: ant.MessagesRequest, request: Request) -> Any:
        self.check_model(body.model)
        body.check()
        job = self._job(
            request,
            body.max_tokens,
            body.sampling(self.config.sampling),
            body.stops(),
            messages=body.chat_messages(),
            tools=body.template_tools(),
            speculate=body.speculate,
            constraint=body.constraint(),
            single_call=body.single_call,
            notes=body.notes(),
        )
        reply = ant.MessageReply(self.config.model_id, show_thinking=body.show_thinking)
        if body.stream:
            return await self._start_stream(
                request, job, lambda start: self._anthropic_events(job, reply, start)
            )
        parts: list[str | ToolCall | Reasoning] = []
        out = await self._whole(request, job, parts)
        return JSONResponse(reply.whole(parts, out))

    async def responses(self, body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API, as a chat (responses.py)."""
        self.check_model(body.model)
        body.check()
        job = self._job(
            request,
            body.limit(self.config.max_tokens),
            body.sampling(self.config.sampling),
            (),
            messages=body.chat_messages(),
            tools=body.template_tools(),
            speculate=body.speculate,
            constraint=body.constraint(),
            single_call=body.parallel_tool_calls is False,
            notes=body.notes(),
        )
        reply = ResponseReply(self.config.model_id, body)
        if body.stream:
            return await self._start_stream(request, job, lambda _: self._responses_events(job, reply))
        parts: list[str | ToolCall | Reasoning] = []
        out = await self._whole(request, job, parts)
        return JSONResponse(reply.whole(parts, out))

    async def count_tokens(self, body: ant.CountTokensRequest) -> dict[str, int]:
        """Tokenized off the engine thread, but bounded like generation: count_concurrency at a time,
        max_queue waiting, more refused with 529."""
        self.check_model(body.model)
        body.check()
        messages, tools = body.chat_messages(), body.template_tools()
        try:
            async with self.counting.slot():
                ids = await asyncio.to_thread(
                    self.worker.prompt_ids, messages=messages, tools=tools, fit=False
                )
        except QueueFullError:
            raise _busy(self.worker) from None
        return {"input_tokens": len(ids)}

    # -- running a job ------------------------------------------------------------------
    def _job(
        self, request: Request, max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...], **what: Any
    ) -> Job:
        job = Job(
            asyncio.get_running_loop(),
            max_tokens,
            sampling,
            stop,
            scope=request.scope.get(SCOPE_KEY, ""),
            **what,
        )
        try:
            self.worker.submit(job)
        except QueueFullError:
            raise _busy(self.worker) from None
        except ShuttingDownError:
            raise APIError(503, SHUTTING_DOWN, code="shutting_down") from None
        return job

    async def _begin(self, request: Request, job: Job) -> tuple[int, int]:
        """Wait for the job's start: (prompt tokens, cached); errors before it are answered with a status."""
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            _, start = await _next(job)
            return start
        except BaseException:
            job.cancel()
            raise
        finally:
            watcher.cancel()

    async def _start_stream(
        self, request: Request, job: Job, events: Callable[[tuple[int, int]], AsyncIterator[str]]
    ) -> StreamingResponse:
        start = await self._begin(request, job)
        return StreamingResponse(
            events(start),
            media_type="text/event-stream",  # it watches the connection
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _whole(self, request: Request, job: Job, parts: list[str | ToolCall | Reasoning]) -> Outcome:
        """Run a job to its end, collecting text pieces, reasoning and tool calls; the client leaving cancels it."""
        await self._begin(request, job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            while True:
                event, value = await _next(job)
                if event == "done":
                    return value
                parts.append(Reasoning(value) if event == "reasoning" else value)
        finally:
            watcher.cancel()
            job.cancel()  # no-op once done; stops the engine if this handler was cancelled

    async def _openai(self, request: Request, job: Job, reply: Reply, body: GenerationRequest) -> Any:
        if body.stream:
            return await self._start_stream(
                request, job, lambda _: self._openai_events(job, reply, body.include_usage)
            )
        parts: list[str | ToolCall | Reasoning] = []
        out = await self._whole(request, job, parts)
        text = "".join(p for p in parts if isinstance(p, str))
        calls = [p for p in parts if isinstance(p, ToolCall)]
        reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
        return JSONResponse(reply.whole(text, out, calls, reasoning))

    async def _openai_events(self, job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        n_calls = 0
        try:
            if reply.kind == "chat":
                yield _sse(reply.chunk(None, first=True))
            async for event, value in _stream_events(job, self.config.ping_s):
                if event == "error":  # after the headers: the error goes in the stream, no [DONE]
                    yield _sse(value.body())
                    return
                if event == "ping":
                    yield ": ping\n\n"
                elif event == "delta":
                    yield _sse(reply.chunk(value))
                elif event == "reasoning":
                    yield _sse(reply.reasoning_chunk(value))
                elif event == "tool_call":
                    yield _sse(reply.tool_chunk(value, n_calls))
                    n_calls += 1
                else:
                    out: Outcome = value
                    yield _sse(
                        {
                            **reply.chunk(None if reply.kind == "chat" else "", out.finish_reason),
                            "edgemoe": out.extension,
                        }
                    )
                    if include_usage:
                        yield _sse(reply.usage_chunk(out))
            yield _sse("[DONE]")
        finally:
            job.cancel()  # the client went away mid-stream (or we are done): free the engine

    async def _anthropic_events(
        self, job: Job, reply: ant.MessageReply, start: tuple[int, int]
    ) -> AsyncIterator[str]:
        try:
            yield reply.start(*start)
            yield ant.PING
            async for event, value in _stream_events(job, self.config.ping_s):
                if event == "error":
                    yield ant.error_event(value)
                elif event == "ping":
                    yield ant.PING
                elif event == "delta":
                    yield reply.text(value)
                elif event == "reasoning":
                    yield reply.thinking(value)
                elif event == "tool_call":
                    yield reply.tool_use(value)
                else:
                    yield reply.end(value)
        finally:
            job.cancel()

    async def _responses_events(self, job: Job, reply: ResponseReply) -> AsyncIterator[str]:
        try:
            yield reply.start()
            async for event, value in _stream_events(job, self.config.ping_s):
                if event == "error":
                    yield reply.failed(value)
                elif event == "ping":
                    yield ": ping\n\n"
                elif event == "delta":
                    yield reply.text(value)
                elif event == "reasoning":
                    yield reply.reasoning(value)
                elif event == "tool_call":
                    yield reply.tool_call(value)
                else:
                    yield reply.end(value)
        finally:
            job.cancel()


def create_app(worker: EngineWorker, config: ServerConfig) -> FastAPI:
    app = FastAPI(
        title="edgemoe",
        summary="OpenAI- and Anthropic-compatible API over one edgemoe Engine",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    install_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        keys=config.api_keys,
        max_body=config.max_body_bytes,
        read_timeout_s=config.read_timeout_s,
        budget=BodyBudget(config.max_bodies_bytes),
    )
    hosts = replace(config.hosts, any_host=True) if config.api_keys else config.hosts  # keys guard it then
    app.add_middleware(FrontMiddleware, hosts=hosts)  # the outermost: every path
    r = Routes(worker, config)
    app.add_api_route("/health", r.health, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", r.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models/{model_id:path}", r.model, methods=["GET", "HEAD"])
    app.add_api_route("/v1/chat/completions", r.chat, methods=["POST"])
    app.add_api_route("/v1/completions", r.completions, methods=["POST"])
    app.add_api_route("/v1/messages", r.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", r.count_tokens, methods=["POST"])
    app.add_api_route("/v1/responses", r.responses, methods=["POST"])
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server that, on SIGINT / SIGTERM, first ends the engine's jobs with a 503 (a stream with an
    error event), so that no client takes a reply cut by the shutdown for a whole one."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker) -> None:
        super().__init__(config)
        self.worker = worker

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        limit_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)
        widen_listen_queue(sockets or [])

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # from a thread: the signal may have interrupted the loop while it held the queue's lock
        threading.Thread(target=self.worker.shutdown, name="edgemoe-shutdown", daemon=True).start()
        super().handle_exit(sig, frame)
