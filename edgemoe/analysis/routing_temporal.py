"""A routing model with the temporal structure of real MoE routers: popularity that drifts per prompt, and
reuse of the experts of the last few tokens (not only the previous one).

Per MoE layer, expert e has a log-popularity that is the sum of a part shared by every prompt
(`concentration` x a standard normal draw, fixed per layer) and a part drawn afresh for each prompt
(`drift` x a standard normal draw): the share of the most used 40% of experts within one prompt follows
sqrt(concentration^2 + drift^2), the share a placement fitted on other prompts covers follows concentration
alone. Each of a token's k slots copies, with probability `copy`, an expert of an earlier token of the same
prompt at a geometric distance (P(d) = (1-g)^(d-1) g with g = `near`, up to `window` tokens back); the other
slots draw without replacement from the prompt's popularity (Gumbel top-k). `copy` and `near` shape the
reuse by the next token and within 8 tokens; `concentration` and `drift` shape the coverage curves.

Each parameter is a number, or a list of values at evenly spaced depths (first to last MoE layer) that
layers in between interpolate (Mixtral's reuse peaks mid-depth). Pure numpy; no model needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Param = float | Sequence[float]


@dataclass(frozen=True)
class TemporalParams:
    concentration: Param  # sd of the log-popularity shared by all prompts
    drift: Param  # sd of the log-popularity drawn per prompt
    copy: Param  # probability that a slot reuses an expert of a recent token
    near: Param  # geometric parameter of how far back the reused token is (1.0: always the previous token)
    window: int = 64  # the farthest token a slot reuses from

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> TemporalParams:
        def p(key: str) -> Param:
            v = d[key]
            return [float(x) for x in v] if isinstance(v, list) else float(v)  # type: ignore[arg-type]

        return cls(
            concentration=p("concentration"),
            drift=p("drift"),
            copy=p("copy"),
            near=p("near"),
            window=int(d.get("window", 64)),  # type: ignore[call-overload]  # a JSON number
        )

    def at(self, name: str, layer: int, n_layer: int) -> float:
        """The parameter's value at MoE layer `layer` of `n_layer` (depth-interpolated when a list)."""
        v = getattr(self, name)
        if isinstance(v, (int, float)):
            return float(v)
        pts = np.asarray(v, np.float64)
        depth = layer / max(n_layer - 1, 1)
        return float(np.interp(depth, np.linspace(0.0, 1.0, len(pts)), pts))


def _one_sequence(
    rng: np.random.Generator, logp: np.ndarray, n_tok: int, k: int, copy: float, near: float, window: int
) -> np.ndarray:
    """(n_tok, k) expert ids of one prompt at one layer."""
    e = logp.shape[0]
    keys = logp[None, :] + rng.gumbel(size=(n_tok, e))
    order = np.argsort(-keys, axis=1)  # each row: a draw without replacement, most likely first
    do_copy = rng.random((n_tok, k)) < copy
    dist = np.minimum(rng.geometric(near, size=(n_tok, k)), window)
    pick = rng.integers(0, k, size=(n_tok, k))
    out = np.empty((n_tok, k), np.int32)
    for t in range(n_tok):
        chosen: list[int] = []
        if t:
            for s in range(k):
                if do_copy[t, s]:
                    x = int(out[t - min(int(dist[t, s]), t), pick[t, s]])
                    if x not in chosen:
                        chosen.append(x)
        for x in order[t]:
            if len(chosen) == k:
                break
            xi = int(x)
            if xi not in chosen:
                chosen.append(xi)
        out[t] = chosen
    return out


def draw_ids(
    params: TemporalParams, *, n_expert: int, k: int, n_layer: int, seq_lens: Sequence[int], seed: int = 0
) -> np.ndarray:
    """(sum(seq_lens), n_layer, k) int32 expert ids, sequences one after the other, k distinct ids per row."""
    rng = np.random.default_rng(seed)
    n = int(sum(seq_lens))
    ids = np.empty((n, n_layer, k), np.int32)
    for j in range(n_layer):
        conc = params.at("concentration", j, n_layer)
        drift = params.at("drift", j, n_layer)
        copy = params.at("copy", j, n_layer)
        near = min(max(params.at("near", j, n_layer), 1e-3), 1.0)
        base = conc * rng.standard_normal(n_expert)
        start = 0
        for length in seq_lens:
            logp = base + drift * rng.standard_normal(n_expert)
            ids[start : start + length, j] = _one_sequence(rng, logp, length, k, copy, near, params.window)
            start += length
    return ids
