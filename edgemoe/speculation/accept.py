"""Which proposed tokens a verification batch accepts, and the token that follows them.

Greedy: a proposal is accepted while it equals the argmax of its row; the first row that disagrees gives the
next token (or the row after the last proposal, when every one was accepted). Sampling: a deterministic proposal
d is accepted with probability p(d); on rejection the token is drawn from p with d removed, renormalised. That
keeps the output distributed exactly as p (P(d) = p(d); P(x != d) = (1 - p(d)) p(x) / (1 - p(d))), the
rule of speculative sampling (accept with min(1, p/q)) for a point-mass draft q.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """`accepted` leading proposals are kept; `token` comes after them (drawn or argmax from row accepted)."""

    accepted: int
    token: int


def accept_greedy(
    rows: Sequence[np.ndarray], proposals: Sequence[int], on_gap: Callable[[float], None] | None = None
) -> Verdict:
    """rows: len(proposals) + 1 rows of logits (row i scores the token after proposal i - 1). on_gap gets the
    top-2 logit gap of each row that decided a token."""
    for i, row in enumerate(rows):
        best = int(np.argmax(row))
        if on_gap is not None:
            on_gap(top2_gap(row))
        if i == len(proposals) or best != proposals[i]:
            return Verdict(i, best)
    raise ValueError(f"{len(rows)} rows for {len(proposals)} proposals: give one row more than proposals")


def accept_sampled(
    probs: Callable[[int, Sequence[int]], np.ndarray], proposals: Sequence[int], rng: np.random.Generator
) -> Verdict:
    """probs(i, accepted_so_far): the distribution of row i given the proposals accepted before it (the
    repetition penalty depends on them)."""
    for i in range(len(proposals) + 1):
        p = probs(i, proposals[:i])
        if i == len(proposals):
            return Verdict(i, draw(p, rng))
        d = proposals[i]
        if rng.random() < p[d]:
            continue
        residual = p.copy()
        residual[d] = 0.0
        total = residual.sum()
        # p(d) = 1 and still rejected happens only when rng.random() == 1.0 (never): keep d then
        return Verdict(i, draw(residual / total, rng) if total > 0 else d)
    raise AssertionError("unreachable")


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the distribution p (float64, sums to 1)."""
    cum = np.cumsum(p)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(p) - 1))


def top2_gap(row: np.ndarray) -> float:
    """The best logit minus the second best."""
    two = np.partition(np.asarray(row, dtype=np.float64), -2)[-2:]
    return float(two[1] - two[0])
