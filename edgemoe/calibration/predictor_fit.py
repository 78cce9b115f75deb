"""Fit every predictor kind on a calibration trace: the `predictors` calibration stage.

The trace's sequences are split 9:1 (ProMoE §4.3) into train and validation; every kind is
fitted on the train part only (the MLPs and the first-layer gate stop early on the validation
part) and scored on the validation part, which goes into card.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from ..analysis.predictor_eval import eval_rows, evaluate, evaluation_to_json
from ..analysis.trace import Trace
from ..analysis.trace_stats import expert_counts
from ..predictors.base import ModelSpec, Predictor, PredictorError
from ..predictors.baselines import PrevTokenPredictor, RandomPredictor, TokenIdPredictor
from ..predictors.gate import GatePredictor, ResidualPredictor
from ..predictors.store import save_predictors, spec_for_model

if TYPE_CHECKING:
    from ..predictors.train import TrainConfig
    from .stages import StageContext

DISTANCES = (1, 2)
VAL_FRACTION = 0.1


def split_rows(trace: Trace, seed: int, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) row indices: whole sequences go to one side (tokens of a sequence are alike)."""
    rows = eval_rows(trace)
    seqs = np.unique(trace.seq[rows])
    if len(seqs) < 2:
        raise PredictorError(
            f"the calibration trace has {len(seqs)} sequence(s); a train/validation split needs "
            "at least 2: raise the calibration's `tokens` or lower its `ctx`"
        )
    rng = np.random.default_rng(seed)
    n_val = max(1, round(len(seqs) * val_fraction))
    val = rng.permutation(seqs)[:n_val]
    in_val = np.isin(trace.seq[rows], val)
    return rows[~in_val], rows[in_val]


def frequency(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """(L, E) share of routed slots per expert."""
    c = expert_counts(ids, n_expert).astype(np.float64)
    return (c / np.maximum(c.sum(1, keepdims=True), 1)).astype(np.float32)


def fit_predictors(
    trace: Trace,
    spec: ModelSpec,
    *,
    cfg: TrainConfig,
    distances: Sequence[int] = DISTANCES,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Predictor], dict[str, Any]]:
    """Every kind at every distance, fitted on the train split; the report includes validation scores."""
    from ..predictors.train import TrainData, train_first_layer, train_mlp

    if trace.gate_inputs is None:
        raise PredictorError("the calibration trace has no gate inputs: record it with `gate_inputs=True`")
    if tuple(int(x) for x in trace.layers) != spec.layers:
        raise PredictorError(
            f"the trace's MoE layers {list(trace.layers)} are not the model's {list(spec.layers)}"
        )
    bad = [d for d in distances if not 1 <= d < spec.n_layers]
    if bad:
        raise PredictorError(f"distances {bad} do not fit a model of {spec.n_layers} MoE layers")
    train_rows, val_rows = split_rows(trace, cfg.seed)
    data = TrainData(gate_inputs=trace.gate_inputs, ids=trace.ids, train_rows=train_rows, val_rows=val_rows)
    freq = frequency(trace.ids[train_rows], spec.n_expert)
    g_train = trace.gate_inputs[train_rows]
    preds: list[Predictor] = []
    training: dict[str, dict[str, Any]] = {"mlp": {}, "first-layer": {}}
    t0 = time.perf_counter()
    token_id = TokenIdPredictor.fit(spec, distances[0], trace.tokens[train_rows], trace.ids[train_rows], freq)
    for d in distances:
        mlp, training["mlp"][f"d{d}"] = train_mlp(spec, d, data, cfg, progress)
        first, training["first-layer"][f"d{d}"] = train_first_layer(spec, d, data, cfg, progress)
        preds += [
            mlp,
            GatePredictor(spec, d),
            ResidualPredictor.fit(spec, d, g_train),
            first,
            PrevTokenPredictor(spec, d, freq),
            TokenIdPredictor(spec, d, token_id.vocab, token_id.top, token_id.frequency),
            RandomPredictor(spec, d, seed=cfg.seed),
        ]
    train_s = time.perf_counter() - t0
    validation = evaluation_to_json(evaluate(preds, trace, rows=val_rows))
    report = {
        "distances": list(distances),
        "train_config": asdict(cfg),
        "split": {
            "train_tokens": len(train_rows),
            "val_tokens": len(val_rows),
            "val_sequences": len(np.unique(trace.seq[val_rows])),
            "by": "sequence",
            "ratio": "9:1",
        },
        "training": training,
        "train_s": round(train_s, 2),
        "validation": validation,
    }
    return preds, report


def predictors_stage(ctx: StageContext) -> dict[str, Any]:
    """The `predictors` calibration stage: fit, score on validation, write predictors/*.npz."""
    from ..predictors.train import TrainConfig

    opts = dict(ctx.options.get("predictors", {}))
    distances = tuple(opts.pop("distances", DISTANCES))
    cfg = TrainConfig(**{"seed": ctx.seed, "threads": ctx.n_threads, **opts})
    trace = ctx.traces()
    spec = spec_for_model(ctx.model)
    with ctx.progress(2 * len(distances) * cfg.epochs, "predictors", unit="epoch") as bar:
        preds, report = fit_predictors(trace, spec, cfg=cfg, distances=distances, progress=bar)
    report["files"] = save_predictors(preds, ctx.out_dir)
    return report
