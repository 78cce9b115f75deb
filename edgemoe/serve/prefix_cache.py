"""Which KV state a request starts from: the live one, a stored one, or none (runs on the engine thread).

The engine keeps one sequence; its KV cache (the live state) holds the last request's prompt and reply.
Before a prompt is evaluated, PrefixReuse.prepare:

1. empties the live state when it belongs to another API key (after storing it under that key);
2. stores the live state when the prompt shares only part of it (an agent switching to another
   conversation comes back to it later);
3. restores the stored state of the same key sharing the longest prefix with the prompt, when it
   shares more than the live state does.

The engine's prefill then evaluates only what follows the shared prefix.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import EdgeMoeError
from ..runtime.prompt_cache import PromptCache, common_prefix

log = logging.getLogger(__name__)


class PrefixReuse:
    def __init__(self, engine: Any, store: PromptCache | None) -> None:
        self.engine = engine
        self.store = store
        self.owner: str | None = None  # the scope of the live state

    def prepare(self, scope: str, ids: list[int]) -> int:
        """Set up the KV cache for the prompt ids of scope; returns the prompt tokens it holds already."""
        eng = self.engine
        live = eng.kv_tokens()
        if scope != self.owner:
            if live:
                self._keep(live)
                eng.reset()
                live = ()
            self.owner = scope
        shared = common_prefix(live, ids)
        if len(live) > shared:  # the prompt (or a restore) throws away part of the live state
            self._keep(live)
        if self.store is not None:
            snap, _ = self.store.lookup(scope, ids, longer_than=shared)
            if snap is not None:
                try:
                    eng.restore(snap)
                except EdgeMoeError as err:  # the prompt is then evaluated in full
                    log.warning("prompt cache: %s", err)
        return eng.cached_prefix(ids)

    def _keep(self, live: tuple[int, ...]) -> None:
        """Store the live state under its owner, unless a stored state covers it already."""
        store = self.store
        if store is None or self.owner is None or len(live) < store.min_prefix:
            return
        if store.covers(self.owner, live):
            return
        snap = self.engine.snapshot()
        if not store.put(self.owner, snap):
            log.info(
                "prompt cache: a state of %d tokens (%d bytes) does not fit %d bytes; not kept",
                len(live),
                snap.nbytes,
                store.capacity_bytes,
            )
