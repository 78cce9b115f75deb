"""The one engine thread: requests wait in a bounded FIFO queue and run one at a time.

The Engine is not thread-safe, so every engine call (chat template, tokenizer, generation,
counters) happens on this thread. A Job carries its events back to the asyncio loop that
submitted it: ("start", prompt tokens), ("delta", text), ("done", Outcome) or ("error", APIError).
A job's `cancel()` (client gone) stops its generation at the next token, or skips it if it waits.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import EdgeMoeError
from ..runtime.chat import ChatMessage
from ..runtime.sampling import SamplingParams
from .errors import APIError

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The wait queue holds max_queue requests already."""


class StopScanner:
    """Cuts generated text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            hold = max(hold, next((k for k in range(min(len(s) - 1, len(self.buf)), 0, -1)
                                   if self.buf.endswith(s[:k])), 0))
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Outcome:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    extension: dict[str, Any]  # the response's "edgemoe" object


@dataclass
class Job:
    """One request: a chat (messages, template applied on the worker) or a plain prompt."""

    loop: asyncio.AbstractEventLoop
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
        """From the worker thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


class EngineWorker:
    """Owns the Engine after start(); one daemon thread runs the queued jobs in order."""

    def __init__(self, engine: Any, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._main, name="edgemoe-engine", daemon=True)
        self._current: Job | None = None
        self.served = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job and everything queued; the thread ends (the engine stays open)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit("error", APIError(503, "the server is shutting down"))
        if self._current is not None:
            self._current.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> Job:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None
        return job

    def _main(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited: end its handler too
                job.emit("error", APIError(499, "the client closed the request", type="cancelled"))
                continue
            self._current = job
            try:
                self._run(job)
            except APIError as err:
                job.emit("error", err)
            except EdgeMoeError as err:
                job.emit("error", APIError(500, str(err), type="server_error"))
            except Exception as err:  # noqa: BLE001 - one bad request must not end the worker
                log.exception("generation failed")
                job.emit("error", APIError(500, f"internal error: {type(err).__name__}: {err}"))
            finally:
                self._current = None
                self.served += 1

    def _tokens(self, job: Job) -> list[int]:
        eng = self.engine
        chat = job.messages is not None
        try:
            prompt = eng.format_chat(job.messages) if chat else job.prompt or ""
        except EdgeMoeError as err:  # no (known) chat template
            raise APIError(400, str(err), param="messages", code="no_chat_template") from err
        ids = eng.tokenize(prompt, parse_special=chat)
        param = "messages" if chat else "prompt"
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param=param)
        if len(ids) >= eng.n_ctx:
            raise APIError(400, f"the prompt is {len(ids)} tokens but the context holds {eng.n_ctx}; "
                                "shorten it or start the server with a larger --ctx",
                           param=param, code="context_length_exceeded")
        return ids

    def _run(self, job: Job) -> None:
        eng = self.engine
        t_start = time.perf_counter()
        ids = self._tokens(job)
        job.emit("start", len(ids))
        stops = StopScanner(job.stop)
        finish: str | None = None
        n_out = 0
        t_first: float | None = None
        gen = eng.stream(ids, max_tokens=job.max_tokens, sampling=job.sampling)
        try:
            for tok, piece in gen:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                n_out += tok >= 0
                t_first = t_first or time.perf_counter()
                text, hit = stops.push(piece)
                if text:
                    job.emit("delta", text)
                if hit:
                    finish = "stop"
                    break
        finally:
            gen.close()
        t_end = time.perf_counter()
        if finish is None:  # the engine ended it: eog, max_tokens or a full context
            g = eng.last
            finish = "stop" if g.stop_reason == "eog" else "length"
            tail = stops.flush()
            if tail:
                job.emit("delta", tail)
            n_out, timings = len(g.tokens), g.timings.to_dict()
        else:  # cut short here: the engine's Generation was not completed
            timings = {"decode_tokens": n_out, "ttft_s": (t_first or t_end) - t_start,
                       "decode_s": t_end - (t_first or t_end)}
        job.emit("done", Outcome(finish, len(ids), n_out, self._extension(job, timings, t_start, t_end)))

    def _extension(self, job: Job, timings: dict[str, Any], t_start: float, t_end: float) -> dict[str, Any]:
        eng = self.engine
        ext: dict[str, Any] = {"timings": timings, "queue_s": t_start - job.submitted,
                               "run_s": t_end - t_start, "gating": eng.gating_report(),
                               "control": eng.control_stats()}
        if eng.cache is not None:
            ext["cache"] = eng.cache.cache.stats()
        return ext
