"""Ctrl-C while llama.cpp runs: recorded, then raised once native code has returned.

Python runs a SIGINT handler at the next bytecode, which during llama_decode is the first line of a
ctypes callback (the routing hook, the cache policy): a KeyboardInterrupt raised there escapes the
callback's own `try`, ctypes prints "Exception ignored" and the decode goes on as if nothing
happened. Around native calls the main thread's default handler is replaced by one that only
records the signal; callbacks ask `pending()` and stop the decode, and the interrupt is raised when
the native call is over.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_pending = threading.Event()


def pending() -> bool:
    """Whether Ctrl-C came during the native call in progress (callbacks stop the decode then)."""
    return _pending.is_set()


def _record(signum: int, frame: object) -> None:
    _pending.set()


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the body with Ctrl-C recorded instead of raised; raise KeyboardInterrupt after it.

    Only on the main thread with Python's default SIGINT handler in place (a server or an
    application with a handler of its own keeps it); nesting is fine.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupted = _pending.is_set()
        _pending.clear()
    if interrupted:
        raise KeyboardInterrupt
