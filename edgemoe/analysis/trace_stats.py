"""Statistics of a routing trace (pure numpy over a Trace; plots live in trace_plots).

- frequency: per-layer expert shares, normalised entropy, skew (hottest share / uniform share)
- temporal locality: P(an expert used by token t is used again by token t+1), same sequence
- high-workload adjacency (DALI): over windows of W tokens (a ubatch), the share of the top-k
  workload experts of one window that are top-k again in the next
- gate-input similarity (AdapMoE Fig. 3): cosine of router inputs of consecutive MoE layers
- prefill vs decode (DAOP eq. 1 / Table II): cosine of the per-layer activation counts of the
  prefill tokens and of the decode tokens
- gate reuse (DAOP Fig. 5): recall of layer l+1's top-k when its router is applied to layer l's input
- reuse over a window: the share of a token's experts that one of the previous w tokens of its sequence used
  (w = 1: the next-token reuse; w = 8: what a cache of a few tokens' experts catches)
- prompt coverage: the share of selections the most used 40% of experts take within one sequence, and what
  the 40% most used on the other sequences cover of it (how far popularity drifts between prompts)
- LRU: hit rate of a per-layer LRU expert cache of each size over the token order
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..predictors.metrics import recall
from .trace import DECODE, PREFILL, Trace


@dataclass
class TraceStats:
    layers: list[int]
    n_expert: int
    k: int
    frequency: np.ndarray  # (L, E) share of routed slots per expert
    entropy: np.ndarray  # (L,) entropy / log(E): 1.0 = uniform
    skew: np.ndarray  # (L,) hottest expert's share * E
    temporal_locality: np.ndarray  # (L,)
    adjacency_window: int
    high_workload_adjacency: np.ndarray  # (L,)
    workload_windows: np.ndarray  # (L, n_windows, E) tokens per expert per window (heatmap)
    adjacency_matrix: np.ndarray  # (L, E, E) [a, b]: a busiest in window w and b in window w+1 (DALI Fig.)
    gate_input_cosine: np.ndarray | None  # (L-1,) between MoE layer j and j+1
    prefill_decode_similarity: np.ndarray | None  # (L,)
    gate_reuse_recall: np.ndarray | None  # (L-1,) predicting layer j+1 from layer j's input
    lru_sizes: np.ndarray  # (S,) cache sizes (experts per layer)
    lru_hit_rate: np.ndarray  # (L, S)
    reuse_next: np.ndarray | None = None  # (L,) share of a token's experts the previous token used
    reuse_within_8: np.ndarray | None = None  # (L,) ... that one of the previous 8 tokens used
    coverage_in_prompt: float | None = None  # top-40% experts of a sequence: their share of its selections
    coverage_other_prompts: float | None = (
        None  # top-40% of the other sequences: their share (None: 1 sequence)
    )

    def to_dict(self) -> dict[str, object]:
        def f(a: np.ndarray | None) -> object:
            return None if a is None else np.round(a.astype(np.float64), 5).tolist()

        return {
            "layers": self.layers,
            "n_expert": self.n_expert,
            "k": self.k,
            "entropy": f(self.entropy),
            "skew": f(self.skew),
            "temporal_locality": f(self.temporal_locality),
            "adjacency_window": self.adjacency_window,
            "high_workload_adjacency": f(self.high_workload_adjacency),
            "gate_input_cosine": f(self.gate_input_cosine),
            "prefill_decode_similarity": f(self.prefill_decode_similarity),
            "gate_reuse_recall": f(self.gate_reuse_recall),
            "lru_sizes": self.lru_sizes.tolist(),
            "lru_hit_rate": f(self.lru_hit_rate),
            "lru_hit_rate_mean": f(self.lru_hit_rate.mean(0)),
            "reuse_next": _mean(self.reuse_next),
            "reuse_within_8": _mean(self.reuse_within_8),
            "reuse_next_per_layer": f(self.reuse_next),
            "reuse_within_8_per_layer": f(self.reuse_within_8),
            "coverage_top40_in_prompt": self.coverage_in_prompt,
            "coverage_top40_other_prompts": self.coverage_other_prompts,
            "frequency": f(self.frequency),
            "mean": {
                "entropy": _mean(self.entropy),
                "skew": _mean(self.skew),
                "temporal_locality": _mean(self.temporal_locality),
                "high_workload_adjacency": _mean(self.high_workload_adjacency),
                "gate_input_cosine": _mean(self.gate_input_cosine),
                "prefill_decode_similarity": _mean(self.prefill_decode_similarity),
                "gate_reuse_recall": _mean(self.gate_reuse_recall),
            },
        }


def _mean(a: np.ndarray | None) -> float | None:
    return None if a is None or a.size == 0 else round(float(np.nanmean(a)), 5)


def expert_counts(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids (T, L, k) -> (L, E) how many tokens each expert served."""
    T, L, k = ids.shape
    out = np.zeros((L, n_expert), np.int64)
    for j in range(L):
        out[j] = np.bincount(ids[:, j].reshape(-1), minlength=n_expert)[:n_expert]
    return out


def usage_masks(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids (T, L, k) -> (T, L, E) bool: which experts each token used."""
    T, L, k = ids.shape
    m = np.zeros((T, L, n_expert), bool)
    np.put_along_axis(m, ids.astype(np.int64), True, axis=2)
    return m


def temporal_locality(ids: np.ndarray, seq: np.ndarray, n_expert: int) -> np.ndarray:
    """(L,) P(expert of token t is used again at t+1), over consecutive tokens of one sequence."""
    m = usage_masks(ids, n_expert)
    same = seq[1:] == seq[:-1]
    a, b = m[:-1][same], m[1:][same]  # (P, L, E)
    return (a & b).sum((0, 2)) / np.maximum(a.sum((0, 2)), 1)


def workload_windows(ids: np.ndarray, n_expert: int, window: int) -> np.ndarray:
    """(L, n_windows, E) tokens per expert in consecutive windows of `window` tokens."""
    T, L, _ = ids.shape
    n = T // window
    out = np.zeros((L, n, n_expert), np.int64)
    for w in range(n):
        out[:, w] = expert_counts(ids[w * window : (w + 1) * window], n_expert)
    return out


def high_workload_adjacency(work: np.ndarray, top: int) -> np.ndarray:
    """(L,) share of each window's `top` busiest experts that are among the next window's `top` busiest."""
    L, n, E = work.shape
    if n < 2:
        return np.full(L, np.nan)
    order = np.argsort(-work, axis=2, kind="stable")[:, :, :top]  # (L, n, top)
    res = np.zeros(L)
    for j in range(L):
        hits = [len(set(order[j, w]) & set(order[j, w + 1])) for w in range(n - 1)]
        res[j] = np.mean(hits) / top
    return res


def adjacency_matrix(work: np.ndarray, top: int) -> np.ndarray:
    """(L, E, E): how often expert a is among the `top` busiest of a window and b of the next one."""
    L, n, E = work.shape
    out = np.zeros((L, E, E), np.int64)
    order = np.argsort(-work, axis=2, kind="stable")[:, :, :top]
    for j in range(L):
        for w in range(n - 1):
            out[j][np.ix_(order[j, w], order[j, w + 1])] += 1
    return out


def gate_input_cosine(gate_inputs: np.ndarray) -> np.ndarray:
    """(L-1,) mean cosine similarity of each token's router input at MoE layer j and j+1."""
    g = gate_inputs.astype(np.float32)
    a, b = g[:, :-1], g[:, 1:]
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12)
    return cos.mean(0)


def prefill_decode_similarity(ids: np.ndarray, phase: np.ndarray, n_expert: int) -> np.ndarray | None:
    """(L,) cosine of the activation-count vectors of prefill and of decode tokens (DAOP eq. 1)."""
    if not (phase == PREFILL).any() or not (phase == DECODE).any():
        return None
    p = expert_counts(ids[phase == PREFILL], n_expert).astype(np.float64)
    d = expert_counts(ids[phase == DECODE], n_expert).astype(np.float64)
    return (p * d).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(d, axis=1) + 1e-12)


def router_probs(router: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Softmax router: router (E, n_embd), x (N, n_embd) -> (N, E)."""
    logits = x.astype(np.float32) @ router.T
    logits -= logits.max(1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(1, keepdims=True)


def gate_reuse_recall(
    ids: np.ndarray, gate_inputs: np.ndarray, routers: dict[int, np.ndarray], layers: list[int]
) -> np.ndarray:
    """(L-1,) recall of layer j+1's top-k from its router applied to layer j's router input."""
    out = np.zeros(len(layers) - 1)
    for j in range(len(layers) - 1):
        out[j] = recall(router_probs(routers[layers[j + 1]], gate_inputs[:, j]), ids[:, j + 1])
    return out


def reuse_distances(ids: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """(T, L, k) float: how many tokens back the same sequence last used each selected expert (inf: not before)."""
    T, L, k = ids.shape
    n_expert = int(ids.max()) + 1 if ids.size else 1
    rows = np.arange(L)[:, None]
    last = np.full((L, n_expert), -1, np.int64)
    out = np.full((T, L, k), np.inf)
    for t in range(T):
        if t and seq[t] != seq[t - 1]:
            last.fill(-1)
        prev = last[rows, ids[t]]
        out[t] = np.where(prev >= 0, t - prev, np.inf)
        last[rows, ids[t]] = t
    return out


def reuse_within(dist: np.ndarray, seq: np.ndarray, window: int) -> np.ndarray:
    """(L,) share of the selections of tokens with a predecessor in their sequence whose expert one of the
    previous `window` tokens used (window 1: the previous token)."""
    has_prev = np.r_[False, seq[1:] == seq[:-1]]
    d = dist[has_prev]
    if d.shape[0] == 0:
        return np.full(dist.shape[1], np.nan)
    return (d <= window).mean(axis=(0, 2))


def prompt_coverage(
    ids: np.ndarray, seq: np.ndarray, n_expert: int, share: float = 0.4
) -> tuple[float, float | None]:
    """Mean over sequences and layers of the share of a sequence's selections taken by its own most used
    `share` of experts, and by the most used `share` of all the other sequences pooled (None: one sequence)."""
    top = max(1, round(share * n_expert))
    seqs = np.unique(seq)
    counts = np.stack([expert_counts(ids[seq == s], n_expert) for s in seqs])  # (S, L, E)
    total = np.maximum(counts.sum(-1), 1)
    own = np.sort(counts, axis=-1)[..., ::-1][..., :top].sum(-1) / total
    if len(seqs) < 2:
        return float(own.mean()), None
    rest = counts.sum(0)[None] - counts
    chosen = np.argsort(-rest, axis=-1, kind="stable")[..., :top]
    other = np.take_along_axis(counts, chosen, axis=-1).sum(-1) / total
    return float(own.mean()), float(other.mean())


def lru_hit_rates(ids: np.ndarray, n_expert: int, sizes: np.ndarray, count_from: int = 0) -> np.ndarray:
    """(L, S) hit rate of a per-layer LRU cache of each size, over the tokens in order; the first `count_from`
    tokens only warm the cache."""
    T, L, k = ids.shape
    out = np.zeros((L, len(sizes)))
    for j in range(L):
        seq = ids[:, j]
        for si, size in enumerate(sizes):
            cache: OrderedDict[int, None] = OrderedDict()
            hits = 0
            for t, row in enumerate(seq):
                for e in row.tolist():
                    if e in cache:
                        hits += t >= count_from
                        cache.move_to_end(e)
                    else:
                        cache[e] = None
                        if len(cache) > size:
                            cache.popitem(last=False)
            out[j, si] = hits / max((T - count_from) * k, 1)
    return out


def compute_stats(
    tr: Trace,
    *,
    routers: dict[int, np.ndarray] | None = None,
    window: int = 32,
    lru_sizes: Sequence[int] | None = None,
) -> TraceStats:
    """Every statistic above; `lru_sizes`: the LRU cache sizes (experts per layer) to replay (default: 8 sizes
    from k to n_expert)."""
    E, k = tr.n_expert, int(tr.ids.shape[2])
    counts = expert_counts(tr.ids, E)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -(np.where(share > 0, share * np.log(share), 0.0)).sum(1) / np.log(E)
    work = workload_windows(tr.ids, E, window)
    if lru_sizes is None:
        sizes = np.unique(np.linspace(k, E, num=min(8, E - k + 1)).round().astype(int))
    else:
        sizes = np.asarray([int(s) for s in lru_sizes], int)
    dist = reuse_distances(tr.ids, tr.seq)
    cov_own, cov_other = prompt_coverage(tr.ids, tr.seq, E)
    return TraceStats(
        layers=[int(x) for x in tr.layers],
        n_expert=E,
        k=k,
        frequency=share,
        entropy=ent,
        skew=share.max(1) * E,
        temporal_locality=temporal_locality(tr.ids, tr.seq, E),
        adjacency_window=window,
        high_workload_adjacency=high_workload_adjacency(work, k),
        workload_windows=work,
        adjacency_matrix=adjacency_matrix(work, k),
        gate_input_cosine=gate_input_cosine(tr.gate_inputs) if tr.gate_inputs is not None else None,
        prefill_decode_similarity=prefill_decode_similarity(tr.ids, tr.phase, E),
        gate_reuse_recall=(
            gate_reuse_recall(tr.ids, tr.gate_inputs, routers, list(tr.layers))
            if tr.gate_inputs is not None and routers
            else None
        ),
        lru_sizes=sizes,
        lru_hit_rate=lru_hit_rates(tr.ids, E, sizes),
        reuse_next=reuse_within(dist, tr.seq, 1),
        reuse_within_8=reuse_within(dist, tr.seq, 8),
        coverage_in_prompt=round(cov_own, 5),
        coverage_other_prompts=None if cov_other is None else round(cov_other, 5),
    )
