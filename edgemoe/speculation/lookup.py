"""Prompt lookup: find the context's last n tokens earlier in the context and propose what followed them.

Coding agents' answers copy long spans of their prompts (files, diffs, tool output); there the tokens after an
earlier occurrence of the current tail are likely the next ones. No model runs: the cost is a search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PromptLookup:
    """An n-gram draft source over the context itself; the longest matching tail (ngram_max down to ngram_min)
    wins, and among its occurrences the latest one (the most recent copy is the likeliest to go on)."""

    name = "lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        ctx = np.asarray(context, dtype=np.int64)
        for size in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            start = latest_match(ctx, size)
            if start >= 0:
                follow = ctx[start + size : start + size + n]
                return [int(t) for t in follow]
        return []

    def close(self) -> None:
        pass


def latest_match(ctx: np.ndarray, size: int) -> int:
    """Start of the latest earlier occurrence of ctx's last `size` tokens that has a token after it; -1: none."""
    if size <= 0 or len(ctx) <= size:
        return -1
    tail = ctx[-size:]
    n_start = len(ctx) - size  # starts 0 .. len-size-1: an occurrence with a token after it
    match = np.ones(n_start, dtype=bool)
    for j in range(size):
        match &= ctx[j : j + n_start] == tail[j]
    hits = np.flatnonzero(match)
    return int(hits[-1]) if len(hits) else -1
