"""One thread at a time on a llama.cpp context: its context is not thread-safe (two decodes at once crash it).

An Engine holds one ThreadGuard; the generation, the decodes and the KV state snapshots run inside hold().
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import EngineBusyError

_lock = threading.Lock()  # protects the fields of every ThreadGuard (held for a few instructions)


class ThreadGuard:
    """Which thread uses one context now, how deep, and whether inside llama_decode (where a hook may run)."""

    def __init__(self, name: str) -> None:
        self.name = name  # the model file's name, for the messages
        self._user: int | None = None  # the thread generating or decoding now
        self._depth = 0  # nested hold() of that thread
        self._decoding = 0  # of which inside llama_decode (a hook may run)

    @contextmanager
    def hold(self, *, native: bool = False) -> Iterator[None]:
        """The body uses llama.cpp for this thread; another thread's call raises EngineBusyError."""
        me = threading.get_ident()
        with _lock:
            if self._user not in (None, me):
                raise EngineBusyError(
                    f"this Engine of {self.name} is generating for another thread: use "
                    "one Engine per thread, or serialize the calls with a lock"
                )
            self._user, self._depth, self._decoding = me, self._depth + 1, self._decoding + native
        try:
            yield
        finally:
            with _lock:
                self._depth -= 1
                self._decoding -= native
                if self._depth == 0:
                    self._user = None

    def check_closable(self) -> None:
        """Raise EngineBusyError while a decode runs (close() from a routing hook) or another thread holds it."""
        with _lock:
            busy = self._decoding or self._user not in (None, threading.get_ident())
        if busy:
            raise EngineBusyError(
                f"this Engine of {self.name} is decoding (close() came from a routing "
                "hook or another thread): close it after the call returns"
            )
