"""Prompt caching across requests: KV states of recent prefixes kept in host memory, LRU by bytes.

- PromptCache: the store, pure Python over opaque byte buffers (tested without llama.cpp). Entries
  belong to a scope (an API key's id): a lookup never returns another scope's entry.
- Engine.snapshot / restore (edgemoe.runtime.sequence.KVSequence) take the one sequence's KV state
  (llama_state_seq_get_data) and restore one (llama_state_seq_set_data), so that the engine's prefix reuse
  then trims it to what the next prompt shares.
- chunk_boundary: where, in a prefill of n_batch-token chunks, the state worth keeping is taken (serve's
  edgemoe.serve.prefix_cache snapshots it there, Engine.watch_prefill).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MIN_PREFIX = 16  # shorter shared prefixes are not worth a restore (or a snapshot)
DEFAULT_SHARE = 0.25  # of the memory available at start, for the default capacity
DEFAULT_MAX = 8 << 30


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_capacity() -> int:
    """A quarter of the memory available now, at most 8 GiB (1 GiB where it cannot be read)."""
    avail = available_memory()
    return 1 << 30 if avail is None else min(DEFAULT_MAX, int(avail * DEFAULT_SHARE))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # a prefix of the shorter
        if x != y:
            break
        n += 1
    return n


def chunk_boundary(start: int, n_prompt: int, chunk: int) -> int | None:
    """The deepest chunk boundary a prefill passes: it evaluates a prompt of n_prompt tokens from `start` (the
    tokens the KV cache holds already) in chunks of `chunk`, and stops between chunks at start + k x chunk
    before the one that holds the prompt's last token; None when that chunk is the first (or chunk is 0)."""
    if chunk <= 0 or n_prompt - 1 - start < chunk:
        return None
    return start + (n_prompt - 1 - start) // chunk * chunk


@dataclass(frozen=True)
class KVSnapshot:
    """The KV state of one sequence holding exactly `tokens`."""

    tokens: tuple[int, ...]
    data: Any  # a ctypes uint8 array (or any object with len()), as llama_state_seq_get_data wrote it
    boundary: bool = False  # taken at a prefill's chunk boundary (not the live state at a switch)

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    bytes: int
    capacity_bytes: int
    stored: int  # snapshots put
    hits: int  # lookups that found a (long enough) prefix
    misses: int
    evicted: int

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class PromptCache:
    """Snapshots by (scope, tokens); lookup() finds the one sharing the longest prefix with a prompt."""

    def __init__(self, capacity_bytes: int, *, min_prefix: int = MIN_PREFIX) -> None:
        self.capacity_bytes = capacity_bytes
        self.min_prefix = min_prefix
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], KVSnapshot] = OrderedDict()  # oldest first
        self.bytes = 0
        self.stored = self.hits = self.misses = self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def scoped(self, scope: str) -> Iterator[KVSnapshot]:
        return (snap for (s, _), snap in self._entries.items() if s == scope)

    def lookup(
        self, scope: str, tokens: Sequence[int], *, longer_than: int = 0
    ) -> tuple[KVSnapshot | None, int]:
        """(the scope's snapshot sharing the longest prefix with tokens, that length); (None, 0) when none
        shares min_prefix tokens and more than longer_than. A hit becomes the most recently used."""
        best, best_n = None, 0
        for snap in self.scoped(scope):
            n = common_prefix(snap.tokens, tokens)
            if n > best_n:
                best, best_n = snap, n
        if best is None or best_n < self.min_prefix or best_n <= longer_than:
            self.misses += 1
            return None, 0
        self.hits += 1
        self._entries.move_to_end((scope, best.tokens))
        return best, best_n

    def covers(self, scope: str, tokens: Sequence[int]) -> bool:
        """Does a stored snapshot of the scope start with all of tokens (storing them would add nothing)?"""
        n = len(tokens)
        return any(len(s.tokens) >= n and s.tokens[:n] == tuple(tokens) for s in self.scoped(scope))

    def put(self, scope: str, snap: KVSnapshot) -> bool:
        """Store snap, dropping the scope's snapshots it extends, then the least recently used until it fits.
        False (nothing stored) when it alone is larger than the capacity or shorter than min_prefix."""
        if snap.nbytes > self.capacity_bytes or len(snap.tokens) < self.min_prefix:
            return False
        n = len(snap.tokens)
        for key in [
            k
            for k, s in self._entries.items()
            if k[0] == scope and len(s.tokens) <= n and snap.tokens[: len(s.tokens)] == s.tokens
        ]:
            self._drop(key)
        while self._entries and self.bytes + snap.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[(scope, snap.tokens)] = snap
        self.bytes += snap.nbytes
        self.stored += 1
        return True

    def _drop(self, key: tuple[str, tuple[int, ...]]) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(
            len(self._entries),
            self.bytes,
            self.capacity_bytes,
            self.stored,
            self.hits,
            self.misses,
            self.evicted,
        )
