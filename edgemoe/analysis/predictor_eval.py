"""Evaluate predictors on a recorded trace (with gate inputs): per target layer and distance, the
metrics of edgemoe.predictors.metrics and the CPU cost of one prediction.

Rows: every token that has a previous token in its sequence (the first token of a sequence
has none, so prev-token and first-layer could not predict it); all kinds are scored on the
same rows. A kind's mean is over the target layers it covers (docs/predictors.md).

Per-token metrics assume decode: the previous token is complete. The high-workload recall
scores windows of W tokens as prefill ubatches: every token of a window sees its own router
inputs of earlier layers (the whole ubatch has run them) but, as "previous token", only the
token just before the window (the tokens inside the ubatch run in parallel).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..predictors import metrics
from ..predictors.base import Known, Predictor, PredictorError, source_of
from .trace import Trace

METRICS = ("recall", "recall_km", "exact", "hw_recall_1", "hw_recall_k")


def eval_rows(trace: Trace) -> np.ndarray:
    """Indices of the tokens that have a previous token in the same sequence."""
    t = np.arange(1, trace.n_tokens)
    return t[trace.seq[1:] == trace.seq[:-1]]


def known_from_trace(
    trace: Trace, target: int, distance: int, rows: np.ndarray, prev_rows: np.ndarray | None = None
) -> Known:
    """What a predictor may see for `rows` (which all need a previous token in their sequence).

    prev_rows: the last complete token of each row (default rows - 1: decode).
    """
    if trace.gate_inputs is None:
        raise PredictorError(
            "the trace has no gate inputs: record it with `gate_inputs=True` (`edgemoe trace --gate-inputs`)"
        )
    off, src = source_of(target, distance, len(trace.layers))
    prev = rows - 1 if prev_rows is None else prev_rows
    return Known(
        target=target,
        distance=distance,
        hidden=trace.gate_inputs[rows if off == 0 else prev, src].astype(np.float32),
        tokens=trace.tokens[rows],
        prev_ids=trace.ids[prev, target],
    )


@dataclass(frozen=True)
class Score:
    """One predictor at one distance. Per-layer arrays are (L,), NaN where the kind does not predict."""

    kind: str
    distance: int
    k: int
    m: int
    window: int
    rows: int
    layers: tuple[int, ...]  # target MoE layer positions covered
    per_layer: dict[str, np.ndarray]  # metric -> (L,)
    cost_us: float | None  # mean CPU time of one single-token prediction of one layer
    n_params: int  # stored parameters per covered layer

    def mean(self, metric: str) -> float:
        a = self.per_layer[metric]
        return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")

    def to_dict(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:
            return None if not np.isfinite(x) else round(float(x), 5)

        d: dict[str, Any] = {m: clean(self.mean(m)) for m in METRICS}
        d.update(
            goodpred=metrics.goodpred(self.mean("recall"), None),
            cost_us=clean(self.cost_us or np.nan),
            n_params=self.n_params,
            k=self.k,
            m=self.m,
            window=self.window,
            rows=self.rows,
            layers=list(self.layers),
            per_layer={m: [clean(x) for x in self.per_layer[m]] for m in METRICS},
        )
        return d


def inference_cost_us(pred: Predictor, known: Known, *, repeats: int = 50) -> float:
    """Best-of-3 mean time of `repeats` calls of scores() on one token (microseconds)."""
    one = Known(
        target=known.target,
        distance=known.distance,
        hidden=known.hidden[:1].copy(),
        tokens=known.tokens[:1].copy(),
        prev_ids=known.prev_ids[:1].copy(),
    )
    pred.scores(one)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            pred.scores(one)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def _window_scores(
    pred: Predictor, trace: Trace, target: int, rows: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """(B, W, E) scores and (B, W, k) true ids of whole windows of rows, as prefill ubatches."""
    blocks = rows[metrics.windows(trace.seq[rows], window)]  # (B, W) trace rows
    B = blocks.shape[0]
    if B == 0:
        return np.zeros((0, window, trace.n_expert), np.float32), np.zeros(
            (0, window, trace.ids.shape[2]), np.int32
        )
    prev = np.repeat(blocks[:, :1] - 1, window, axis=1)  # the token before the ubatch
    known = known_from_trace(trace, target, pred.distance, blocks.reshape(-1), prev.reshape(-1))
    return pred.scores(known).reshape(B, window, -1), trace.ids[blocks, target]


def score_predictor(
    pred: Predictor,
    trace: Trace,
    *,
    rows: np.ndarray | None = None,
    m: int | None = None,
    window: int = 32,
    timing: bool = True,
) -> Score:
    L, k = len(trace.layers), trace.ids.shape[2]
    m = max(1, k // 2) if m is None else m
    rows = eval_rows(trace) if rows is None else rows
    per = {name: np.full(L, np.nan) for name in METRICS}
    covered, costs = [], []
    for target in range(L):
        if not pred.covers(target):
            continue
        covered.append(target)
        known = known_from_trace(trace, target, pred.distance, rows)
        s = pred.scores(known)
        true = trace.ids[rows, target]
        per["recall"][target] = metrics.recall(s, true)
        per["recall_km"][target] = metrics.recall(s, true, k + m)
        per["exact"][target] = metrics.exact_set(s, true)
        sb, tb = _window_scores(pred, trace, target, rows, window)
        per["hw_recall_1"][target] = metrics.high_workload_recall(sb, tb, top=1)
        per["hw_recall_k"][target] = metrics.high_workload_recall(sb, tb, top=k)
        if timing and len(rows):
            costs.append(inference_cost_us(pred, known))
    return Score(
        kind=pred.kind.value,
        distance=pred.distance,
        k=k,
        m=m,
        window=window,
        rows=len(rows),
        layers=tuple(covered),
        per_layer=per,
        cost_us=float(np.mean(costs)) if costs else None,
        n_params=pred.n_params(),
    )


Evaluation = dict[str, dict[int, Score]]  # kind -> distance -> Score


def evaluate(
    predictors: Sequence[Predictor],
    trace: Trace,
    *,
    rows: np.ndarray | None = None,
    m: int | None = None,
    window: int = 32,
    timing: bool = True,
) -> Evaluation:
    out: Evaluation = {}
    for p in predictors:
        out.setdefault(p.kind.value, {})[p.distance] = score_predictor(
            p, trace, rows=rows, m=m, window=window, timing=timing
        )
    return out


def evaluation_to_json(ev: Evaluation) -> dict[str, dict[str, Any]]:
    """{kind: {"d1": {"recall": r, ..., "per_layer": {...}}, "d2": {...}}}"""
    return {kind: {f"d{d}": s.to_dict() for d, s in sorted(by_d.items())} for kind, by_d in ev.items()}


def format_evaluation(ev: Evaluation | dict[str, dict[str, Any]]) -> str:
    """A text table: one row per kind, the layer means of each metric at each distance.

    Takes an Evaluation or its JSON form (evaluation_to_json, or a card's "validation").
    """
    if any(isinstance(v, Score) for by_d in ev.values() for v in by_d.values()):
        js = evaluation_to_json(cast(Evaluation, ev))
    else:
        js = cast("dict[str, dict[str, Any]]", ev)
    dists = sorted({key for by_d in js.values() for key in by_d}, key=lambda x: int(x[1:]))
    first = next(s for by_d in js.values() for s in by_d.values())
    k, m = first["k"], first["m"]
    cols = [
        ("recall", f"top{k}"),
        ("recall_km", f"top{k + m}"),
        ("exact", "exact"),
        ("hw_recall_1", "hw@1"),
        ("hw_recall_k", f"hw@{k}"),
        ("cost_us", "us"),
    ]

    def cell(x: float | None, metric: str) -> str:
        return f"{'-':>6}" if x is None else f"{x:6.1f}" if metric == "cost_us" else f"{x:6.3f}"

    head = f"{'kind':<12}" + "".join(f" | {d}: " + " ".join(f"{c:>6}" for _, c in cols) for d in dists)
    lines = [head, "-" * len(head)]
    for kind, by_d in js.items():
        lines.append(
            f"{kind:<12}"
            + "".join(
                f" | {d}: " + " ".join(cell(by_d[d].get(mk) if d in by_d else None, mk) for mk, _ in cols)
                for d in dists
            )
        )
    lines.append(
        f"top{k}: recall of the true top-{k} in the predicted top-{k} (top{k + m}: in the predicted "
        f"top-{k + m}); exact: same set; hw@h: DALI high-workload recall over {first['window']}-token "
        "ubatches; us: CPU time of one single-token prediction of one layer. Means over the target "
        f"layers each kind covers, {first['rows']} tokens. GoodPred needs the runtime's timing (later issue)."
    )
    return "\n".join(lines)
