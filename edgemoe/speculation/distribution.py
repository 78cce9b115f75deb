"""The distribution llama.cpp's sampler chain draws from, as numpy over one row of logits.

The chain (edgemoe.runtime.sampling.Sampler) is penalties -> top-k -> top-p -> min-p -> temperature -> draw; the
filters see the raw logits, the temperature only scales what they kept. Speculative sampling needs the
probabilities themselves (to accept a proposed token with probability p and to draw from the residual), which
llama.cpp's chain does not hand out, so they are computed here by the same rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Sampling(Protocol):
    """The sampling settings the distribution follows (edgemoe.runtime.sampling.SamplingParams)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def repeat_penalty(self) -> float: ...
    @property
    def repeat_last_n(self) -> int: ...
    @property
    def greedy(self) -> bool: ...


class TokenDistribution:
    """Probabilities of the next token under SamplingParams (greedy: a point mass on the first largest logit),
    with the repetition penalty over the tokens generated so far, as llama.cpp applies it."""

    def __init__(self, params: Sampling) -> None:
        self.params = params

    def probs(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """A float64 vector over the vocabulary that sums to 1."""
        x = np.asarray(logits, dtype=np.float64).copy()
        p = self.params
        if p.repeat_penalty != 1.0 and p.repeat_last_n != 0:
            x = penalize(x, history, p.repeat_penalty, p.repeat_last_n)
        out = np.zeros_like(x)
        if p.greedy:
            out[int(np.argmax(x))] = 1.0
            return out
        keep = np.argsort(-x, kind="stable")  # candidates best first, as llama.cpp sorts them
        if 0 < p.top_k < len(keep):
            keep = keep[: p.top_k]
        if p.top_p < 1.0:
            keep = keep[: top_p_count(x[keep], p.top_p)]
        if p.min_p > 0.0:
            keep = keep[x[keep] >= x[keep[0]] + np.log(p.min_p)]
        z = x[keep] / p.temperature
        w = np.exp(z - z.max())
        out[keep] = w / w.sum()
        return out


def top_p_count(sorted_logits: np.ndarray, top_p: float) -> int:
    """How many of the candidates (best first) top-p keeps: the fewest whose probabilities reach top_p, one at
    the least."""
    w = np.exp(sorted_logits - sorted_logits[0])
    cum = np.cumsum(w / w.sum())
    return max(1, int(np.searchsorted(cum, top_p) + 1))


def penalize(x: np.ndarray, history: Sequence[int], penalty: float, last_n: int) -> np.ndarray:
    """llama.cpp's repetition penalty (no frequency or presence term): each token of the last `last_n`
    generated ones (-1: all) has a positive logit divided by `penalty`, a negative one multiplied by it."""
    window = list(history) if last_n < 0 else list(history)[-last_n:]
    for tok in Counter(window):
        x[tok] = x[tok] / penalty if x[tok] > 0 else x[tok] * penalty
    return x
