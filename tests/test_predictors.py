"""Expert predictors: metrics on hand-made arrays with known answers, the interface on synthetic traces,
every kind above chance on the fixtures, and the artifact round trip."""
from __future__ import annotations

from math import comb
from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.predictor_eval import evaluate, evaluation_to_json, format_evaluation, known_from_trace
from edgemoe.analysis.trace import Trace
from edgemoe.predictors import (
    GatePredictor,
    Known,
    ModelSpec,
    PredictorError,
    PredictorKind,
    PrevTokenPredictor,
    RandomPredictor,
    TokenIdPredictor,
    create_predictor,
    load_predictors,
    metrics,
    mlp_hidden,
    parse_kind,
    save_predictors,
    source_of,
    topk_ids,
)

from helpers.models import FIXTURE_MODELS


# -- metrics -----------------------------------------------------------------------------------------
def test_topk_ids_best_first_ties_to_lower_id() -> None:
    s = np.array([[0.1, 0.9, 0.5, 0.9], [1.0, 1.0, 1.0, 1.0]])
    assert topk_ids(s, 3).tolist() == [[1, 3, 2], [0, 1, 2]]


def test_recall_exact_and_top_k_plus_m() -> None:
    # E = 6, k = 2. Row 0: both right; row 1: one right (also in top-4); row 2: none in top-2, both in top-4.
    scores = np.array([[9, 8, 0, 0, 0, 0],
                       [9, 0, 8, 7, 6, 0],
                       [0, 0, 9, 8, 7, 6]], float)
    true = np.array([[1, 0], [0, 1], [4, 5]])
    assert metrics.recall(scores, true) == pytest.approx((1 + 0.5 + 0) / 3)
    assert metrics.recall(scores, true, 4) == pytest.approx((1 + 0.5 + 1) / 3)
    assert metrics.exact_set(scores, true) == pytest.approx(1 / 3)
    assert metrics.hits(np.array([[0, 1]]), np.array([[1, -1]])).tolist() == [1]  # -1 = no expert
    assert metrics.recall(scores[:1], np.array([[1, -1]])) == 1.0  # recall over the valid ids only


def test_high_workload_recall_known_windows() -> None:
    E, k = 4, 1
    # window 0: true workload 0:3, 1:1 -> busiest expert 0; prediction says 0 -> hit
    # window 1: true workload 2:2, 3:2 (a tie) -> either is a hit; prediction says 3 -> hit
    # window 2: true busiest 1; prediction says 2 -> miss
    true = np.array([[[0], [0], [0], [1]], [[2], [3], [2], [3]], [[1], [1], [1], [0]]])
    pred_ids = np.array([[0, 0, 1, 0], [3, 3, 2, 3], [2, 2, 1, 2]])
    scores = np.zeros((3, 4, E))
    np.put_along_axis(scores, pred_ids[..., None], 1.0, axis=2)
    assert metrics.high_workload_recall(scores, true, top=1) == pytest.approx(2 / 3)
    # top 2: window 0 true {0, 1}, predicted {0, 1}: 1.0; window 1 {2, 3} vs {3, 2}: 1.0;
    # window 2 true {1, 0}, predicted {2, 1}: 0.5
    assert metrics.high_workload_recall(scores, true, top=2) == pytest.approx((1 + 1 + 0.5) / 3)
    assert np.isnan(metrics.high_workload_recall(np.zeros((0, 4, E)), np.zeros((0, 4, k), int), top=1))


def test_windows_stay_inside_sequences() -> None:
    seq = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1])
    assert metrics.windows(seq, 2).tolist() == [[0, 1], [2, 3], [5, 6], [7, 8]]


def test_chance_and_goodpred() -> None:
    c = metrics.chance(32, 4, 2)
    assert c == {"recall": 4 / 32, "recall_km": 6 / 32, "exact": 1 / comb(32, 4)}
    assert metrics.goodpred(0.8, None) is None and metrics.goodpred(0.8, 0.5) == pytest.approx(0.4)


# -- the interface on synthetic traces -----------------------------------------------------------------
def test_source_of_wraps_to_previous_token() -> None:
    assert source_of(3, 1, 8) == (0, 2)
    assert source_of(3, 2, 8) == (0, 1)
    assert source_of(0, 1, 8) == (-1, 7)  # AdapMoE: first layer from the last layer of the previous token
    assert source_of(0, 2, 8) == (-1, 6) and source_of(1, 2, 8) == (-1, 7)
    with pytest.raises(PredictorError):
        source_of(8, 1, 8)


def test_parse_kind_and_factory_fail_loudly() -> None:
    assert parse_kind("prev-token") is PredictorKind.PREV_TOKEN
    with pytest.raises(PredictorError, match="use one of mlp, gate"):
        parse_kind("lstm")
    spec = ModelSpec(layers=(0, 1), n_expert=4, k=1, n_embd=3)
    with pytest.raises(PredictorError, match="edgemoe calibrate"):
        create_predictor("mlp", spec, 1)
    assert isinstance(create_predictor("random", spec, 1), RandomPredictor)


def _synthetic(T: int = 400, L: int = 3, E: int = 8, k: int = 2, n_embd: int = 16, seed: int = 0) -> tuple[Trace, ModelSpec]:
    """Routing that is exactly each layer's router applied to the previous layer's input."""
    rng = np.random.default_rng(seed)
    routers = {j: rng.normal(size=(E, n_embd)).astype(np.float32) for j in range(L)}
    g = rng.normal(size=(T, L, n_embd)).astype(np.float16)
    ids = np.zeros((T, L, k), np.int32)
    for j in range(L):
        src = g[:, j - 1] if j else g[:, 0]
        ids[:, j] = topk_ids(src.astype(np.float32) @ routers[j].T, k)
    tr = Trace(tokens=rng.integers(0, 50, T).astype(np.int32), layers=np.arange(L, dtype=np.int32), ids=ids,
               weights=np.full((T, L, k), 1 / k, np.float32), phase=np.zeros(T, np.uint8),
               seq=(np.arange(T) // 100).astype(np.int32), gate_inputs=g, meta={"n_expert": E})
    return tr, ModelSpec(layers=tuple(range(L)), n_expert=E, k=k, n_embd=n_embd, routers=routers)


def test_known_from_trace_reads_the_source_position() -> None:
    tr, _ = _synthetic()
    rows = np.array([5, 6, 150])
    kn = known_from_trace(tr, 2, 1, rows)
    np.testing.assert_array_equal(kn.hidden, tr.gate_inputs[rows, 1].astype(np.float32))
    np.testing.assert_array_equal(kn.prev_ids, tr.ids[rows - 1, 2])
    kn0 = known_from_trace(tr, 0, 1, rows)  # wraps to the previous token's last layer
    np.testing.assert_array_equal(kn0.hidden, tr.gate_inputs[rows - 1, 2].astype(np.float32))
    kb = known_from_trace(tr, 0, 1, rows, prev_rows=np.array([4, 4, 4]))  # a ubatch: only token 4 is complete
    np.testing.assert_array_equal(kb.hidden, np.repeat(tr.gate_inputs[4:5, 2], 3, 0).astype(np.float32))


def test_gate_reuse_is_exact_when_routing_is_the_next_router() -> None:
    tr, spec = _synthetic()
    ev = evaluate([GatePredictor(spec, 1), RandomPredictor(spec, 1)], tr, window=10, timing=False)
    gate = ev["gate"][1]
    assert gate.layers == (1, 2)
    assert gate.mean("recall") == pytest.approx(1.0) and gate.mean("exact") == pytest.approx(1.0)
    assert np.isnan(gate.per_layer["recall"][0])  # layer 0 is not a within-token target at d = 1
    assert ev["random"][1].mean("recall") == pytest.approx(2 / 8, abs=0.05)


def test_prev_token_and_token_id_on_their_ideal_traces() -> None:
    tr, spec = _synthetic()
    const = tr.ids.copy()
    const[:] = [3, 5]  # every token uses experts 3, 5 everywhere: the previous token is always right
    tr_const = Trace(**{**tr.__dict__, "ids": const})
    assert evaluate([PrevTokenPredictor(spec, 1)], tr_const, timing=False)["prev-token"][1].mean("recall") == 1.0
    # routing a pure function of the token id: token-id fitted on the first half is exact on the second
    by_token = np.stack([np.arange(50) % 8, (np.arange(50) + 3) % 8], 1)
    tr_tok = Trace(**{**tr.__dict__, "ids": np.repeat(by_token[tr.tokens][:, None, :], 3, 1).astype(np.int32)})
    freq = np.full((3, 8), 1 / 8, np.float32)
    tid = TokenIdPredictor.fit(spec, 1, tr_tok.tokens[:200], tr_tok.ids[:200], freq)
    rows = np.arange(201, 400)
    rows = rows[np.isin(tr_tok.tokens[rows], tr_tok.tokens[:200])]
    assert evaluate([tid], tr_tok, rows=rows, timing=False)["token-id"][1].mean("recall") == 1.0


def test_json_and_table_shapes() -> None:
    tr, spec = _synthetic()
    ev = evaluate([GatePredictor(spec, d) for d in (1, 2)] + [RandomPredictor(spec, 1)], tr, window=10)
    js = evaluation_to_json(ev)
    assert set(js) == {"gate", "random"} and set(js["gate"]) == {"d1", "d2"}
    d2 = js["gate"]["d2"]
    assert d2["per_layer"]["recall"][:2] == [None, None] and d2["layers"] == [2]
    assert d2["goodpred"] is None and d2["cost_us"] > 0 and d2["k"] == 2 and d2["m"] == 1
    table = format_evaluation(ev)
    assert "gate" in table and "top3" in table and "GoodPred" in table
    assert format_evaluation(js) == table  # the JSON form (a card's validation) prints the same


def test_mlp_size_rule() -> None:
    assert mlp_hidden(256) == 128 and mlp_hidden(2048) == 128 and mlp_hidden(7168) == 128 and mlp_hidden(64) == 64
    assert mlp_hidden(160) == 80


# -- on the fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def fitted(request: pytest.FixtureRequest) -> tuple[Path, list, dict, Trace]:  # type: ignore[type-arg]
    """All predictors fitted on ~3k train-split tokens (3 epochs) and a 1k-token held-out trace."""
    import torch

    from edgemoe.analysis.trace import record_trace
    from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
    from edgemoe.calibration.predictor_fit import fit_predictors
    from edgemoe.predictors import spec_for_model
    from edgemoe.predictors.train import TrainConfig
    from edgemoe.runtime.engine import Engine, LoadConfig

    torch.set_num_threads(1)
    model = request.param
    sp = {n: split_corpus(default_corpus_dir() / f"{n}.txt") for n in ("tinyshakespeare", "python-docs")}
    with Engine(model, LoadConfig(n_ctx=128, n_threads=1)) as eng:
        train = [t for n in sp for t in eng.tokenize(sp[n].train_text()[:40000])[:1536]]
        held = [t for n in sp for t in eng.tokenize(sp[n].heldout_text()[:8000])[:512]]
        cal = record_trace(eng, train, ctx=128, mode="prefill", gate_inputs=True)
        ev = record_trace(eng, held, ctx=128, mode="prefill", gate_inputs=True)
    spec = spec_for_model(model)
    preds, report = fit_predictors(cal, spec, cfg=TrainConfig(epochs=3, threads=1))
    return model, preds, report, ev


def test_every_kind_beats_random_on_held_out_text(fitted) -> None:  # type: ignore[no-untyped-def]
    _, preds, report, ev = fitted
    res = evaluate(preds, ev, timing=False)
    assert set(res) == {k.value for k in PredictorKind}
    chance = res["random"]
    for kind, by_d in res.items():
        if kind == "random":
            continue
        for d, s in by_d.items():
            assert s.mean("recall") > chance[d].mean("recall") + 0.03, (kind, d, s.mean("recall"))
    # ProMoE's premise, even on this tiny budget: the learned predictor beats gate reuse at d = 2
    assert res["mlp"][2].mean("recall") > res["gate"][2].mean("recall")
    # the card's report: validation scores of every kind, the MLP's early-stopping record
    assert set(report["validation"]) == set(res) and report["split"]["val_tokens"] > 0
    assert report["training"]["mlp"]["d1"]["hidden"] == 128


def test_artifacts_round_trip(fitted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from edgemoe.predictors import spec_for_model

    model, preds, _, ev = fitted
    entries = save_predictors(preds, tmp_path)
    names = sorted(p.name for p in (tmp_path / "predictors").iterdir())
    assert "mlp-d2.npz" in names and "token-id.npz" in names and "gate-d1.npz" not in names
    back = load_predictors(tmp_path, entries, spec_for_model(model))
    assert [(p.kind, p.distance) for p in back] == [(p.kind, p.distance) for p in preds]
    rows = np.arange(1, 60)
    for a, b in zip(preds, back, strict=False):
        if a.kind is PredictorKind.RANDOM:
            continue
        for t in range(len(ev.layers)):
            if a.covers(t):
                kn = known_from_trace(ev, t, a.distance, rows)
                np.testing.assert_array_equal(a.scores(kn), b.scores(kn), err_msg=f"{a.kind} d={a.distance}")
    only = load_predictors(tmp_path, entries, spec_for_model(model), kinds=["mlp"], distances=[2])
    assert [(p.kind.value, p.distance) for p in only] == [("mlp", 2)]


def test_known_is_all_a_predictor_sees() -> None:
    spec = ModelSpec(layers=(0, 1), n_expert=4, k=2, n_embd=2)
    kn = Known(target=1, distance=1, hidden=np.zeros((2, 2), np.float32), tokens=np.array([1, 2], np.int32),
               prev_ids=np.array([[3, 1], [-1, -1]], np.int32))
    s = PrevTokenPredictor(spec, 1).scores(kn)
    assert topk_ids(s, 2)[0].tolist() == [3, 1]  # the previous token's experts, router order kept
    assert np.isfinite(s[1]).all()  # no previous token: falls back to the frequency order
