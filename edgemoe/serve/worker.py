"""The one engine thread: requests wait in a bounded FIFO queue and run one at a time.

The Engine is not thread-safe, so every use of its llama.cpp context (prefix reuse, generation,
counters) happens on this thread; only the chat template and the tokenizer, which read the model's
vocabulary, also run on the server's threads (count_tokens). A Job carries its events back to the
asyncio loop that submitted it: ("start", (prompt tokens, cached tokens)), ("delta", text),
("reasoning", text), ("tool_call", ToolCall), ("done", Outcome) or ("error", APIError). A job's `cancel()`
(client gone, or the server shutting down) stops its prompt's evaluation at the next chunk boundary (n_batch
tokens), its generation at the next token, or skips it if it waits.

Prompt caching (prefix_cache.py): before a prompt is evaluated, the live KV state is kept in the
host-memory store when the prompt would throw part of it away, and a stored state sharing a longer
prefix with the prompt is restored; states are scoped by API key.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import EdgeMoeError
from ..runtime.chat import ChatMessage
from ..runtime.generation import Generation
from ..runtime.prompt_cache import PromptCache
from ..runtime.sampling import GREEDY, SamplingParams
from ..speculation.config import SpeculationStats
from .conversation import normalize, prefill_of, render_chat
from .errors import APIError, ContextOverflow, internal_error
from .grammar import Constraint
from .prefix_cache import PrefillStopped, PrefixReuse
from .reasoning import opens_reasoning
from .scripted import Script
from .specials import SpecialGuard, control_texts
from .stops import StopScanner
from .stream import ReplySplitter
from .template import ChatTemplate

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The wait queue holds max_queue requests already."""


class ShuttingDownError(Exception):
    """The server is shutting down: it takes no more requests."""


SHUTTING_DOWN = "the server is shutting down; the reply was cut short: retry on a running server"


@dataclass
class Outcome:
    finish_reason: str  # "stop" | "length" | "tool_calls" (a cancelled job ends with an error instead)
    prompt_tokens: int
    completion_tokens: int
    extension: dict[str, Any]  # the response's "edgemoe" object
    cached_tokens: int = 0  # prompt tokens whose KV state was reused (not evaluated)
    stop_sequence: str | None = None  # the stop string that ended the reply


@dataclass
class Job:
    """One request: a chat (messages, template applied on the worker) or a plain prompt."""

    loop: asyncio.AbstractEventLoop
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    messages: list[dict[str, Any]] | None = None  # OpenAI-shaped (template.py)
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    scope: str = ""  # whose prompt-cache entries it may reuse (the API key's id)
    speculate: bool = True  # use the engine's speculative decoding, where it has one
    constraint: Constraint | None = None  # a grammar the reply must follow (response_format, a forced call)
    single_call: bool = False  # parallel tool calls off: the reply ends after its first call
    notes: tuple[str, ...] = ()  # what the server changed in the request (the reply's edgemoe.notes)
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    reason: APIError | None = None  # why the server cancelled it (None: its client left)

    def cancel(self, reason: APIError | None = None) -> None:
        if reason is not None and not self.cancelled.is_set():
            self.reason = reason
        self.cancelled.set()

    def cut_short(self) -> APIError:
        """The error a cancelled job ends with (no client may take a cut reply for a whole one)."""
        return self.reason or APIError(499, "the client closed the request", type="cancelled")

    def emit(self, kind: str, value: Any) -> None:
        """From the worker thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


class EngineWorker:
    """Owns the Engine after start(); one daemon thread runs the queued jobs in order.

    template: the model's Jinja chat template (None: llama.cpp's built-in templates, no tools);
    prompt_cache: the host-memory store of KV states (None: only the live KV prefix is reused);
    keep_live: store each request's live KV state under its key when it is over (a server with several keys:
    a key switch then does no work that depends on the other key's state);
    scripted: replies to give instead of sampling (tests of the tool-call path and of real clients).
    """

    def __init__(
        self,
        engine: Any,
        max_queue: int,
        *,
        template: ChatTemplate | None = None,
        prompt_cache: PromptCache | None = None,
        keep_live: bool = False,
        scripted: Script | list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.template = template
        # the prefill's chunk boundaries, every n_batch tokens: states kept, cancellation (0: a stand-in engine)
        self.reuse = PrefixReuse(
            engine, prompt_cache, chunk=getattr(engine, "n_batch", 0), keep_live=keep_live
        )
        self.scripted = Script.parse(scripted) if isinstance(scripted, list) else scripted
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._main, name="edgemoe-engine", daemon=True)
        self._current: Job | None = None
        self.served = 0
        self.closing = False  # set by shutdown(): no more jobs
        self.guard = SpecialGuard(())  # the vocabulary's control tokens, read by start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        self.guard = SpecialGuard(control_texts(self.engine))
        self._thread.start()

    def shutdown(self) -> None:
        """Take no more jobs; end the running one and those queued with a 503 (a signal handler may call
        it: it only sets flags and hands events to the loop)."""
        self.closing = True
        err = APIError(503, SHUTTING_DOWN, code="shutting_down")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel(err)
                job.emit("error", err)
        if (current := self._current) is not None:
            current.cancel(err)

    def stop(self, timeout: float = 10.0) -> None:
        """shutdown(), then the thread ends (the engine stays open)."""
        self.shutdown()
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> Job:
        if self.closing:
            raise ShuttingDownError
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None
        return job

    def _main(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited: end its handler too
                job.emit("error", job.cut_short())
                continue
            self._current = job
            try:
                self._run(job)
            except APIError as err:
                job.emit("error", err)
            except Exception as err:  # noqa: BLE001 - one bad request must not end the worker
                job.emit("error", internal_error(err))
            finally:
                self.reuse.done()
                self._current = None
                self.served += 1

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text of a chat through the model's template (thread-safe: no llama.cpp context)."""
        if self.template is not None:
            return render_chat(self.template, messages, tools)
        messages = normalize(messages)
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            raise APIError(
                400,
                "this model's chat template cannot be rendered with jinja2, so the server "
                "has no tool support for it: send the request without tools",
                param="tools",
                code="tools_unsupported",
            )
        prefill = prefill_of(messages)
        if prefill is not None:
            messages = messages[:-1]
        try:
            chat = [ChatMessage(m["role"], m.get("content") or "") for m in messages]
            return self.engine.format_chat(chat) + (prefill or "")
        except EdgeMoeError as err:  # no (known) chat template
            raise APIError(400, str(err), param="messages", code="no_chat_template") from err

    def prompt_ids(
        self,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        fit: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The prompt's token ids (thread-safe); APIError 400 when it is empty, or (fit) when it fills the context,
        naming the prompt's tokens, the `max_tokens` asked (where given) and the context. A prompt that fits with
        a reply that would not is served: the reply stops where the context ends (finish "length")."""
        return self._prompt(messages, tools, prompt, fit=fit, max_tokens=max_tokens)[0]

    def _prompt(
        self,
        messages: list[dict[str, Any]] | None,
        tools: list[dict[str, Any]] | None,
        prompt: str | None,
        *,
        fit: bool = True,
        max_tokens: int | None = None,
    ) -> tuple[list[int], str]:
        """prompt_ids, and the prompt's text (a chat's as rendered, with placeholders for client control text)."""
        eng = self.engine
        chat = messages is not None
        param = "messages" if chat else "prompt"
        if messages is not None:
            ids, text = self._chat_ids(messages, tools)
        else:
            text = _text(prompt or "", param)
            ids = eng.tokenize(text, add_special=True, parse_special=False)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param=param)
        if fit and len(ids) >= eng.n_ctx:
            reply = f" and max_tokens asks for {max_tokens} more" if max_tokens is not None else ""
            raise ContextOverflow(
                f"the prompt is {len(ids)} tokens{reply}, but the context holds {eng.n_ctx}; "
                "shorten it or start the server with a larger context (`n_ctx`)",
                prompt_tokens=len(ids),
                n_ctx=eng.n_ctx,
                param=param,
            )
        return ids, text

    def _chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], str]:
        """A chat's prompt ids (the template's control tokens parsed, the client's text as plain text) and text."""
        (messages, tools), swapped = self.guard.neutralize([messages, tools])
        text = self.render(messages, tools)
        _text(self.guard.restore(text) if swapped else text, "messages")  # placeholders are not text
        bos = self.template.bos_token if self.template is not None else ""
        add_bos = not (self.engine.adds_bos() and bos and text.startswith(bos))  # the template wrote BOS
        return self.guard.tokenize(self.engine, text, add_bos=add_bos, swapped=swapped), text

    def _run(self, job: Job) -> None:
        eng = self.engine
        t_start = time.perf_counter()
        ids, text = self._prompt(job.messages, job.tools, job.prompt, max_tokens=job.max_tokens)
        thinking = job.messages is not None and opens_reasoning(text)  # the template opened a reasoning block
        sampling = job.sampling
        if job.constraint is not None:
            sampling = replace(sampling, grammar=job.constraint.grammar(reasoning_open=thinking))
        cached = self.reuse.prepare(job.scope, ids, stop=job.cancelled.is_set)
        job.emit("start", (len(ids), cached))
        stops = StopScanner(job.stop)
        split = ReplySplitter(
            tools=bool(job.tools),
            reasoning=job.messages is not None,
            reasoning_open=thinking,
            single_call=job.single_call,
        )

        def emit(piece: str, final: bool = False) -> None:
            for kind, value in split.push(piece) + (split.flush() if final else []):
                job.emit(kind, value)

        finish: str | None = None
        spec: SpeculationStats | None = None  # what speculation did (a completed generation's)
        n_out = 0
        t_first: float | None = None
        scripted = self.scripted is not None
        gen = (
            self._scripted(job, ids, text)
            if scripted
            else eng.stream(ids, max_tokens=job.max_tokens, sampling=sampling, speculate=job.speculate)
        )
        try:
            for tok, piece in gen:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                n_out += tok >= 0
                t_first = t_first or time.perf_counter()
                out, hit = stops.push(piece)
                emit(out)
                if hit or split.done:  # a stop string, or the one tool call allowed
                    finish = "stop"
                    break
        except PrefillStopped:  # cancelled while its prompt was evaluated
            finish = "cancelled"
        finally:
            gen.close()
        if finish is None and job.cancelled.is_set():  # during the prefill, and no token came after it
            finish = "cancelled"
        if finish == "cancelled":
            job.emit("error", job.cut_short())
            return
        t_end = time.perf_counter()
        if finish is None:  # the engine ended it: eog, max_tokens or a full context
            g: Generation = self._script_last if scripted else eng.last
            finish = "stop" if g.stop_reason == "eog" else "length"
            emit(stops.flush(), final=True)
            n_out, timings = len(g.tokens), g.timings.to_dict()
            spec = g.speculation
        else:  # a stop string: the engine's Generation was not completed
            emit("", final=True)
            timings = {
                "decode_tokens": n_out,
                "ttft_s": (t_first or t_end) - t_start,
                "decode_s": t_end - (t_first or t_end),
            }
        if split.n_calls and finish == "stop" and stops.hit is None:
            finish = "tool_calls"
        ext = self._extension(job, timings, t_start, t_end)
        if spec is not None:
            ext["speculation"] = spec.to_dict()
        job.emit("done", Outcome(finish, len(ids), n_out, ext, cached, stops.hit))

    _script_last: Generation

    def _scripted(self, job: Job, ids: list[int], prompt: str) -> Generator[tuple[int, str], None, None]:
        """The next scripted reply as if sampled: the prompt is evaluated for real (prefix reuse included). A job
        cancelled meanwhile (its client gave up during a long prefill) leaves the script as it was, for a retry."""
        eng, max_tokens = self.engine, job.max_tokens
        first = eng.generate(ids, max_tokens=1, sampling=GREEDY)
        assert self.scripted is not None
        text = "" if job.cancelled.is_set() else self.scripted.take(prompt)
        reply = eng.tokenize(text, add_special=False, parse_special=True)
        for tok in reply[:max_tokens]:
            yield tok, eng.detokenize([tok])
        stop = "eog" if len(reply) <= max_tokens else "length"
        self._script_last = Generation(
            eng.detokenize(reply[:max_tokens]), ids, reply[:max_tokens], stop, first.timings
        )

    def _extension(self, job: Job, timings: dict[str, Any], t_start: float, t_end: float) -> dict[str, Any]:
        eng = self.engine
        ext: dict[str, Any] = {
            "timings": timings,
            "queue_s": t_start - job.submitted,
            "run_s": t_end - t_start,
            "gating": eng.gating_report(),
            "control": eng.control_stats(),
        }
        if eng.experts is not None:
            ext["cache"] = eng.experts.stats()
        if self.reuse.store is not None:
            ext["prompt_cache"] = self.reuse.stats(job.scope)
        if job.notes:
            ext["notes"] = list(job.notes)
        return ext


def _text(text: str, param: str) -> str:
    """text, when UTF-8 can encode it (a lone surrogate slipped past the request checks gives a 400)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400,
            f"the {param} hold a lone UTF-16 surrogate, which is not text: send valid Unicode",
            param=param,
            code="invalid_unicode",
        ) from None
    return text
