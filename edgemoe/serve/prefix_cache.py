"""Which KV state a request starts from: the live one, a stored one, or none (runs on the engine thread).

The engine keeps one sequence; its KV cache (the live state) holds the last request's prompt and reply.
Before a prompt is evaluated, PrefixReuse.prepare:

1. empties the live state when it belongs to another API key, without storing it: the work of a switch does
   not depend on the other key's state, so a request's latency does not tell the size of another key's
   context. With `keep_live` (a server with several keys), done() stores each request's live state under its
   key when the request is over, on that key's time, so that the key finds it after a switch;
2. stores the live state when the prompt shares only part of it (an agent switching to another
   conversation comes back to it later);
3. restores the stored state of the same key sharing the longest prefix with the prompt, when it
   shares more than the live state does.

The engine's prefill then evaluates only what follows the shared prefix, in chunks of n_batch tokens. With a
`chunk` (the engine's n_batch), a prompt whose prefill runs past a chunk also leaves a state in the store, taken
at its deepest chunk boundary (runtime.prompt_cache.chunk_boundary) while the prefill runs: the conversation's
next turn finds it even where the live state is gone and could not be kept (another conversation ran, the
reply was cancelled, its whole state was larger than the store). Between chunks the prefill also asks whether
its request was cancelled (its client left, the server shuts down) and stops there (PrefillStopped). One state per conversation: a state drops the
scope's states whose tokens it extends (PromptCache.put), the live state kept at a switch drops the boundary
it grew from, and no boundary is taken where a stored state holds it already (docs/serve.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..errors import EdgeMoeError
from ..runtime.prompt_cache import KVSnapshot, PromptCache, chunk_boundary, common_prefix

log = logging.getLogger(__name__)


class PrefillStopped(Exception):
    """Raised between a prefill's chunks when its request was cancelled (the KV cache holds the chunks done)."""


class PrefixReuse:
    def __init__(
        self, engine: Any, store: PromptCache | None, *, chunk: int = 0, keep_live: bool = False
    ) -> None:
        self.engine = engine
        self.store = store
        self.chunk = chunk  # the prefill's chunk (the engine's n_batch); 0: no chunk boundaries to visit
        self.keep_live = keep_live  # store each request's live state when it is over (several keys)
        self.owner: str | None = None  # the scope of the live state
        # per scope: what one API key may see of the store (never another key's figures)
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.stored: Counter[str] = Counter()
        self.boundaries: Counter[str] = Counter()  # states taken at a chunk boundary and stored
        self.restored: Counter[str] = (
            Counter()
        )  # prompt tokens a restore brought back (not in the live state)
        self._held: dict[str, tuple[int, int]] = {}  # scope -> (entries, bytes), as prepare() left them

    def stats(self, scope: str) -> dict[str, int]:
        """The store's figures for one scope: its entries and bytes, its lookups' hits and misses (any thread:
        it reads what the engine thread published)."""
        entries, nbytes = self._held.get(scope, (0, 0))
        return {
            "entries": entries,
            "bytes": nbytes,
            "capacity_bytes": self.store.capacity_bytes if self.store is not None else 0,
            "stored": self.stored[scope],
            "hits": self.hits[scope],
            "misses": self.misses[scope],
            "boundary_stored": self.boundaries[scope],
            "restored_tokens": self.restored[scope],
        }

    def _publish(self) -> None:
        held: dict[str, tuple[int, int]] = {}
        for scope in set(self.stored) | set(self.hits) | set(self.misses) | set(self.boundaries):
            snaps = list(self.store.scoped(scope)) if self.store is not None else []
            held[scope] = (len(snaps), sum(s.nbytes for s in snaps))
        self._held = held  # one assignment: readers see the old figures or the new ones

    def prepare(self, scope: str, ids: list[int], stop: Callable[[], bool] | None = None) -> int:
        """Set up the KV cache for the prompt ids of scope; returns the prompt tokens it holds already. The
        prefill that follows raises PrefillStopped at a chunk boundary once stop() is true."""
        eng = self.engine
        live = eng.kv_tokens()
        if scope != self.owner:
            if live:  # emptied, never stored here: the switch costs the same whatever the other key held
                eng.reset()
                live = ()
            self.owner = scope
        shared = common_prefix(live, ids)
        if len(live) > shared:  # the prompt (or a restore) throws away part of the live state
            self._keep(live)
        if self.store is not None:
            snap, n = self.store.lookup(scope, ids, longer_than=shared)
            (self.misses if snap is None else self.hits)[scope] += 1
            if snap is not None:
                try:
                    eng.restore(snap)
                    self.restored[scope] += min(n, len(ids) - 1) - min(shared, len(ids) - 1)
                except EdgeMoeError as err:  # the prompt is then evaluated in full
                    log.warning("prompt cache: %s", err)
            self._publish()
        cached = eng.cached_prefix(ids)
        self._watch(scope, ids, cached, stop)
        return cached

    def _boundary(self, scope: str, ids: list[int], cached: int) -> int | None:
        """The chunk boundary whose state the prefill should store (None: none, or a stored state holds it)."""
        store = self.store
        if store is None:
            return None
        at = chunk_boundary(cached, len(ids), self.chunk)
        if at is None or at < store.min_prefix or store.covers(scope, ids[:at]):
            return None
        return at

    def _watch(self, scope: str, ids: list[int], cached: int, stop: Callable[[], bool] | None) -> None:
        """Between the chunks of the prefill that follows: stop when asked, and store the state at its deepest
        chunk boundary (where none is stored)."""
        if not self.chunk:
            return
        at = self._boundary(scope, ids, cached)
        if at is None and stop is None:
            self.engine.watch_prefill(None)
            return

        def on_chunk(n: int) -> None:
            nonlocal at
            if stop is not None and stop():
                raise PrefillStopped
            if n != at:
                return
            at = None
            snap = self.engine.snapshot()
            assert self.store is not None
            if self.store.put(scope, KVSnapshot(snap.tokens, snap.data, boundary=True)):
                self.boundaries[scope] += 1
                self._publish()

        self.engine.watch_prefill(on_chunk)

    def done(self) -> None:
        """The request is over: a boundary its prefill did not reach is not taken later; with keep_live its
        live state is stored under its key (on this request's time, not the next key's)."""
        if self.chunk:
            self.engine.watch_prefill(None)
        if self.keep_live and self.store is not None:
            live = self.engine.kv_tokens()
            if live:
                self._keep(live)
                self._publish()

    def _keep(self, live: tuple[int, ...]) -> None:
        """Store the live state under its owner, unless a stored state covers it already."""
        store = self.store
        if store is None or self.owner is None or len(live) < store.min_prefix:
            return
        if store.covers(self.owner, live):
            return
        snap = self.engine.snapshot()
        if store.put(self.owner, snap):
            self.stored[self.owner] += 1
        else:
            log.info(
                "prompt cache: a state of %d tokens (%d bytes) does not fit %d bytes; not kept",
                len(live),
                snap.nbytes,
                store.capacity_bytes,
            )
