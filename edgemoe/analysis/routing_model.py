"""A routing model calibrated on a real trace, to make traces for routing shapes no trained model here has.

The performance model needs the routing of, say, a 128-expert top-8 model; our trained fixtures
route 32 or 8 experts. `routing_stats` measures two properties of a real trace per MoE layer that
decide what an expert cache sees: how concentrated expert use is (the share of routed slots the
most used q-fraction of experts take, as a curve over q) and how much consecutive tokens of a
sequence share experts (the fraction of a token's experts the previous token also used).
`synthesize_trace` draws a trace of any expert count and top-k with the same two curves: each
token keeps a Binomial draw of the previous token's experts (the reuse less what chance gives) and fills the rest from the
layer's popularity (expert ids permuted per layer). Expert weights are a sorted Dirichlet draw and
carry no information (do not gate on them). Traces made here say so in their meta.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import EdgeMoeError
from .trace import DECODE, PREFILL, Trace

QUANTILES = np.linspace(0.0, 1.0, 65)


@dataclass(frozen=True)
class RoutingStats:
    mass: (
        np.ndarray
    )  # (L, len(QUANTILES)): share of routed slots taken by the most used q-fraction of experts
    reuse: np.ndarray  # (L,): share of a token's experts the previous token of its sequence also used
    source: str = ""


def routing_stats(trace: Trace) -> RoutingStats:
    n_tok, n_layer, k = trace.ids.shape
    e = trace.n_expert
    mass = np.zeros((n_layer, len(QUANTILES)))
    reuse = np.zeros(n_layer)
    same_seq = trace.seq[1:] == trace.seq[:-1]
    for j in range(n_layer):
        ids = trace.ids[:, j, :]
        counts = np.bincount(ids[ids >= 0], minlength=e).astype(np.float64)
        cum = np.r_[0.0, np.cumsum(np.sort(counts)[::-1])] / max(counts.sum(), 1.0)
        mass[j] = np.interp(QUANTILES * e, np.arange(e + 1), cum)
        prev, cur = ids[:-1][same_seq], ids[1:][same_seq]
        shared = [len(set(a) & set(b)) for a, b in zip(prev.tolist(), cur.tolist(), strict=False)]
        reuse[j] = float(np.mean(shared)) / k if shared else 0.0
    return RoutingStats(mass=mass, reuse=reuse, source=str(trace.meta.get("model", "")))


def _shares(mass: np.ndarray, n_expert: int) -> np.ndarray:
    """Per-expert shares (descending) whose mass curve over quantiles follows `mass`."""
    cum = np.interp(np.arange(n_expert + 1) / n_expert, QUANTILES, mass)
    return np.maximum(np.diff(cum), 1e-12)


def synthesize_trace(
    stats: RoutingStats,
    *,
    n_expert: int,
    k: int,
    n_layer: int,
    n_seq: int,
    prefill: int,
    decode: int,
    seed: int = 0,
) -> Trace:
    """A trace of n_seq sequences (prefill then decode tokens) with the statistics' concentration and reuse;
    model MoE layer j follows stats layer j mod L."""
    if not 1 <= k <= n_expert:
        raise EdgeMoeError(f"top-{k} of {n_expert} experts is not a routing shape")
    rng = np.random.default_rng(seed)
    n_src = stats.mass.shape[0]
    per_seq = prefill + decode
    n = n_seq * per_seq
    ids = np.zeros((n, n_layer, k), np.int32)
    for j in range(n_layer):
        p = _shares(stats.mass[j % n_src], n_expert)
        p = p[rng.permutation(n_expert)]
        p /= p.sum()
        # fresh draws from the popularity land in the previous token's set by chance (about k * sum p^2 of
        # them): keep fewer on purpose so that the total reuse matches
        chance = min(0.95, k * float(np.sum(p * p)))
        keep_p = max(0.0, (float(stats.reuse[j % n_src]) - chance) / (1.0 - chance))
        for t in range(n):
            chosen: list[int] = []
            if t % per_seq:
                prev = ids[t - 1, j]
                m = rng.binomial(k, keep_p)
                chosen = [int(x) for x in rng.choice(prev, size=m, replace=False)] if m else []
            if len(chosen) < k:
                q = p.copy()
                q[chosen] = 0.0
                q /= q.sum()
                chosen += [int(x) for x in rng.choice(n_expert, size=k - len(chosen), replace=False, p=q)]
            ids[t, j] = chosen
    weights = np.sort(rng.dirichlet(np.ones(k), size=(n, n_layer)), axis=-1)[..., ::-1].astype(np.float32)
    phase = np.tile(np.r_[np.full(prefill, PREFILL), np.full(decode, DECODE)], n_seq).astype(np.uint8)
    seq = np.repeat(np.arange(n_seq), per_seq).astype(np.int32)
    meta = {
        "n_expert": n_expert,
        "n_expert_used": k,
        "mode": "decode",
        "synthetic_routing": True,
        "calibrated_on": stats.source,
        "note": "routing drawn by edgemoe.analysis.routing_model: "
        "concentration and token-to-token reuse of the source trace; weights carry no information",
    }
    return Trace(
        tokens=np.zeros(n, np.int32),
        layers=np.arange(n_layer, dtype=np.int32),
        ids=ids,
        weights=np.ascontiguousarray(weights),
        phase=phase,
        seq=seq,
        meta=meta,
    )
