"""Prediction metrics (pure numpy; score arrays in, numbers out).

- recall (ProMoE's "accuracy", Fig. 8): share of the true top-k found in the predicted top-k
- recall at top-(k+m): the same with k+m experts predicted (a prefetch of a few more experts)
- exact-set accuracy: the predicted top-k is exactly the true set
- high-workload recall (DALI Table 2, Fig. 16b): over windows of consecutive tokens (a prefill
  ubatch), are the `top` experts with the most predicted tokens among the `top` busiest
  experts of the window? Ties in the true workload count as hits. The caller builds the
  window's scores from what is known for a whole ubatch (edgemoe.analysis.predictor_eval).
- GoodPred (ProMoE §4.1) = Accuracy x FetchRate: FetchRate needs the runtime's copy timing
  (a later issue), so it is a placeholder here.
"""

from __future__ import annotations

from math import comb

import numpy as np

from .base import topk_ids


def hits(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    """(N,) how many of each row's true ids (N, k; -1 = none) are in the predicted ids (N, n)."""
    found = (pred[:, :, None] == true[:, None, :]).any(1) & (true >= 0)
    return found.sum(1)


def recall(scores: np.ndarray, true: np.ndarray, n: int | None = None) -> float:
    """Mean share of the true experts (N, k) found in the top-n of scores (N, E); n defaults to k."""
    k_row = (true >= 0).sum(1)
    ok = k_row > 0
    if not ok.any():
        return float("nan")
    pred = topk_ids(scores[ok], true.shape[1] if n is None else n)
    return float((hits(pred, true[ok]) / k_row[ok]).mean())


def exact_set(scores: np.ndarray, true: np.ndarray) -> float:
    """Share of rows whose predicted top-k is exactly the true set of k experts."""
    k = true.shape[1]
    if true.shape[0] == 0:
        return float("nan")
    return float((hits(topk_ids(scores, k), true) == k).mean())


def windows(seq: np.ndarray, window: int) -> np.ndarray:
    """(B, window) row indices: consecutive rows of one sequence, cut into whole windows."""
    out = []
    for s in np.unique(seq):
        idx = np.nonzero(seq == s)[0]
        n = len(idx) // window
        if n:
            out.append(idx[: n * window].reshape(n, window))
    return np.concatenate(out) if out else np.zeros((0, window), np.int64)


def workload(ids: np.ndarray, n_expert: int, weight: np.ndarray | None = None) -> np.ndarray:
    """ids (..., W, k) -> (..., E) tokens routed to each expert (optionally weighted per slot)."""
    onehot = ids[..., None] == np.arange(n_expert)
    w = onehot if weight is None else onehot * weight[..., None]
    return w.sum((-3, -2)).astype(np.float64)


def high_workload_recall(scores: np.ndarray, true: np.ndarray, *, top: int) -> float:
    """DALI's high-workload recall over B windows (prefill ubatches) of W tokens.

    scores (B, W, E), true (B, W, k). The predicted workload of an expert is the number of
    window tokens whose predicted top-k holds it (ties broken by rank); the `top` experts with
    the most predicted tokens are compared with the `top` busiest in truth.
    """
    if scores.shape[0] == 0:
        return float("nan")
    E, k = scores.shape[2], true.shape[2]
    pred = topk_ids(scores.reshape(-1, E), k).reshape(*scores.shape[:2], k)  # (B, W, k)
    rank_w = 1.0 + 1e-3 * (k - np.arange(k)) / k  # earlier ranks weigh a little more
    pw = workload(pred, E, np.broadcast_to(rank_w, pred.shape))  # (B, E)
    tw = workload(true, E)  # (B, E)
    pred_top = np.argsort(-pw, axis=1, kind="stable")[:, :top]
    thresh = -np.sort(-tw, axis=1)[:, top - 1 : top]  # the top-th largest true workload
    got = np.take_along_axis(tw, pred_top, 1)
    hit = (got >= thresh) & (got > 0)
    return float(hit.sum(1).mean() / top)


def chance(n_expert: int, k: int, m: int) -> dict[str, float]:
    """What uniform random scores achieve in expectation."""
    return {
        "recall": k / n_expert,
        "recall_km": min(k + m, n_expert) / n_expert,
        "exact": 1.0 / comb(n_expert, k),
    }


def goodpred(accuracy: float, fetch_rate: float | None) -> float | None:
    """ProMoE's GoodPred: correct experts that are also prefetched in time. None until the
    runtime measures FetchRate (the share of predicted experts whose copy completes before use)."""
    return None if fetch_rate is None else accuracy * fetch_rate
