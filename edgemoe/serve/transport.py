"""The connections under the app: uvicorn's h11 protocol held to the limits a server facing hostile clients
needs (docs/serve.md, "Limits").

- A head timeout: each request's line and headers must arrive within `header_timeout_s` of the connection's
  start or of the previous response's end, or the connection is closed. It also ends idle keep-alive
  connections. (uvicorn's keep-alive timer restarts on any byte, and nothing timed a head at all: a client
  sending nothing, or a byte now and then, held a connection forever.)
- A connection cap below the process's limit of open files: past `max_connections`, the connection idle the
  longest (no request in progress) is closed to make room, or the new one when none is idle. The server never
  runs out of file descriptors, so accept() never fails (asyncio logs each failure with a traceback, for
  every queued connection, every second).
- A request head (its line and headers) of at most `max_head_bytes`, however TCP splits it: h11 checks only a
  head still incomplete, so one arriving whole in one read passed at any size. A larger head gets a 431.
- A write timeout: a client that reads nothing of a response for `write_timeout_s` is disconnected.

What these close is counted and logged at most once every LOG_EVERY_S, never a line per connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
LINGER_S = 2.0  # after refusing a request, what the client still sends is read (and dropped) this long
BACKLOG = 128  # the connections asyncio accepts per loop iteration (it listens with this queue at first)
LISTEN_QUEUE = 4096  # the kernel's queue of connections not accepted yet (the kernel caps it: somaxconn)
_ACCEPT_ERROR = "socket.accept() out of system resource"


@dataclass(frozen=True)
class TransportLimits:
    header_timeout_s: float = 10.0  # each request's line and headers must arrive within it
    max_connections: int = 1000  # open at once; past it the connection idle the longest is closed
    max_head_bytes: int = 32 << 10  # a request's line and headers; larger: 431
    write_timeout_s: float = 600.0  # a client that reads nothing of a response for this long is dropped


def fit_connections(requested: int) -> int:
    """The connections the server may hold: `requested`, after raising the soft limit of open files toward
    what they need (never above the hard limit), or fewer where the limit is lower. Room is left for the
    files the process holds and for the connections accepted before the cap closes any (a few BACKLOGs)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return requested
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    room = in_use + 32 + 4 * BACKLOG
    if soft != resource.RLIM_INFINITY and soft < requested + room:
        want = requested + room if hard == resource.RLIM_INFINITY else min(requested + room, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - room))


def widen_listen_queue(sockets: list[socket.socket]) -> None:
    """Let the kernel queue LISTEN_QUEUE connections while asyncio accepts BACKLOG per iteration (it takes one
    number for both): a burst of connections waits to be accepted, and then closed or served, instead of
    overflowing into half-open connections the server never sees."""
    for sock in sockets:
        sock.listen(LISTEN_QUEUE)


def limit_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log a failing accept() once per LOG_EVERY_S, in one line (asyncio logs a traceback per attempt)."""
    last = [float("-inf")]
    before = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_ERROR:
            if before is not None:
                before(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - last[0] >= LOG_EVERY_S:
            last[0] = now
            log.error(
                "accept() failed: %s; new connections wait (raise the limit of open files)",
                context.get("exception"),
            )

    loop.set_exception_handler(handler)


class _Book:
    """One server's connections: those open, the idle ones in the order they became idle, and the counts of
    what was closed, for the log."""

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.open: set[LimitedH11Protocol] = set()
        self.idle: OrderedDict[LimitedH11Protocol, None] = OrderedDict()
        self.closed: Counter[str] = Counter()
        self._logged = float("-inf")
        self._flushing: asyncio.TimerHandle | None = None

    def admit(self, conn: LimitedH11Protocol) -> bool:
        """Count a new connection in, closing the longest idle ones past the cap; False: none was idle."""
        self.open.add(conn)
        while len(self.open) > self.limits.max_connections and self.idle:
            oldest = next(iter(self.idle))
            oldest.drop("closed idle to make room")
        return len(self.open) <= self.limits.max_connections

    def waiting(self, conn: LimitedH11Protocol) -> None:
        self.idle[conn] = None
        self.idle.move_to_end(conn)

    def busy(self, conn: LimitedH11Protocol) -> None:
        self.idle.pop(conn, None)

    def forget(self, conn: LimitedH11Protocol) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def note(self, what: str) -> None:
        """Count a closed connection; the counts go to the log at once, or LOG_EVERY_S after the last line."""
        self.closed[what] += 1
        wait = self._logged + LOG_EVERY_S - time.monotonic()
        if wait <= 0:
            self._flush()
        elif self._flushing is None:
            self._flushing = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flushing = None
        if self.closed:
            counts = ", ".join(f"{n} {w}" for w, n in self.closed.items())
            log.warning("connections: %s (%d open)", counts, len(self.open))
            self.closed.clear()
        self._logged = time.monotonic()


class _HeadLimitedConnection(h11.Connection):
    """h11's server side, refusing a request head over max_head bytes however it arrived (431)."""

    def __init__(self, max_head: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head
        self.refusal: h11.RemoteProtocolError | None = None  # why the last request was refused

    def next_event(self) -> Any:
        waiting = self.their_state is h11.IDLE
        held = len(self._receive_buffer) if waiting else 0  # h11's own buffer (no public size)
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.refusal = err
            raise
        if waiting and isinstance(event, h11.Request) and held - len(self._receive_buffer) > self.max_head:
            self.refusal = h11.RemoteProtocolError("request head too large", error_status_hint=431)
            raise self.refusal
        return event


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; protocol_class() gives it a server's book."""

    book: ClassVar[_Book]

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.conn = _HeadLimitedConnection(self.book.limits.max_head_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._running: object = None  # the request-response cycle whose head arrived last
        self._lingering = False  # a refused request's answer is sent: what follows is dropped

    # -- the connection's life ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.book.admit(self):
            self.drop("refused: all connections busy")
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.forget(self)
        self._cancel_timers()
        super().connection_lost(exc)

    def drop(self, why: str) -> None:
        """Close the connection now (idle: no request of it is running), counting why."""
        self.book.note(why)
        self.book.forget(self)
        self._cancel_timers()
        if self.transport.is_closing():
            return
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    # -- the head clock --------------------------------------------------------------------------------
    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.book.limits.header_timeout_s, self._head_late)
        self.book.waiting(self)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.drop(f"without a request head within {self.book.limits.header_timeout_s:g} s")

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._running and not self.transport.is_closing():
            self._running = self.cycle  # a request's head arrived: its clock stops
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self.book.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (handle_events)
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._await_head()

    def send_400_response(self, msg: str) -> None:
        """A request h11 refused (or a head over the limit: 431), answered, then a lingering close."""
        refusal = self.conn.refusal
        status, reason = 400, b"Bad Request"
        if refusal is not None and refusal.error_status_hint == 431:
            status, reason = 431, b"Request Header Fields Too Large"
            kib = self.book.limits.max_head_bytes >> 10
            msg = f"the request's line and headers are larger than {kib} KiB; send less"
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        try:
            for event in (
                h11.Response(status_code=status, headers=headers, reason=reason),
                h11.Data(data=msg.encode()),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:  # a response was under way: nothing more can be said
            self.transport.close()
            return
        self._linger()

    def _linger(self) -> None:
        """Half-close, then drop what the client still sends for LINGER_S before closing: closing with its bytes
        unread would reset the connection, and the client could lose the answer."""
        self._lingering = True
        self._cancel_timers()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._head_timer = self.loop.call_later(LINGER_S, self.transport.close)
        self.book.waiting(self)  # may be closed at once to make room

    # -- a client that reads nothing -------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.book.limits.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        self.book.note(f"reading nothing for {self.book.limits.write_timeout_s:g} s")
        self.transport.abort()  # close() would wait for the unread response to drain

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._stall_timer = None


def protocol_class(limits: TransportLimits) -> type[LimitedH11Protocol]:
    """The protocol class of one server (uvicorn.Config's `http`), its connections counted in one book."""
    return type("EdgemoeH11Protocol", (LimitedH11Protocol,), {"book": _Book(limits)})
