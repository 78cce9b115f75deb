"""A stand-in for Engine's KV state, for the prompt cache's and the server's pure parts."""
from __future__ import annotations

from edgemoe.runtime.prompt_cache import KVSnapshot, common_prefix


class FakeEngine:
    """The KV-state part of Engine: a list of tokens, snapshots that copy it."""

    def __init__(self) -> None:
        self.kv: list[int] = []
        self.snapshots = 0
        self.restores = 0

    def kv_tokens(self) -> tuple[int, ...]:
        return tuple(self.kv)

    def reset(self) -> None:
        self.kv = []

    def snapshot(self) -> KVSnapshot:
        self.snapshots += 1
        return KVSnapshot(tuple(self.kv), bytes(4 * len(self.kv)))

    def restore(self, s: KVSnapshot) -> None:
        self.restores += 1
        self.kv = list(s.tokens)

    def cached_prefix(self, tokens: list[int]) -> int:
        return min(common_prefix(self.kv, tokens), len(tokens) - 1)

    def run(self, prompt: list[int], reply: list[int]) -> None:  # what a generation leaves in the cache
        self.kv = prompt + reply[:-1]
