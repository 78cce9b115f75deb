"""Expert predictors inside llama.cpp's graph: the ids equal the numpy predictors'.

For every covered target layer, the native top-n_out ids of a ubatch are compared with the numpy
predictor's top-n_out on the router inputs a routing hook recorded in the same decode (float32, the
graph's own values). With F32 weights the two differ only in summation order, so ids may differ
only where the numpy scores of the two experts are within 1e-4 (relative): a near-tie, which must
be rare. The predictor is a side branch of the graph: logits with and without it are bitwise equal.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.calibration import find_calibration
from edgemoe.errors import EdgeMoeError
from edgemoe.gguf.info import read_model_info
from edgemoe.plan.budget import slot_budget
from edgemoe.policies.route import RouteRecord
from edgemoe.predictors import Known, Predictor, topk_ids
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.prediction import default_n_out, device_bytes

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 2
# small ubatches: the prompt takes several, and the predictions are those of the last one
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=16)
N_DECODE = 8
REL_TIE = 1e-4


class GateInputs:
    """A route policy keeping each layer's router input of the last ubatch (float32 copies)."""

    wants_probs = False
    wants_gate_inp = True

    def __init__(self) -> None:
        self.by_layer: dict[int, np.ndarray] = {}

    def on_route(self, route: RouteRecord) -> None:
        assert route.gate_inp is not None
        self.by_layer[route.layer] = np.array(route.gate_inp, dtype=np.float32)


def _predictors(model: Path, kind: str, d: int) -> list[Predictor]:
    return find_calibration(model).predictors(model, kinds=[kind], distances=[d])


def _compare(native_ids: np.ndarray, scores: np.ndarray) -> int:
    """Assert native ids = numpy's top-n of scores up to near-ties; returns how many ids were such swaps."""
    n_tok, n_out = native_ids.shape
    assert scores.shape[0] == n_tok
    assert ((native_ids >= 0) & (native_ids < scores.shape[1])).all()
    assert all(len(set(row)) == n_out for row in native_ids.tolist()), "an expert predicted twice"
    ref = topk_ids(scores, n_out)
    ties = 0
    for t, j in zip(*np.nonzero(native_ids != ref), strict=False):
        a, b = scores[t, native_ids[t, j]], scores[t, ref[t, j]]
        assert abs(a - b) <= REL_TIE * max(abs(a), abs(b)), (
            f"token {t}, rank {j}: native expert {native_ids[t, j]} ({a}) vs numpy {ref[t, j]} ({b})")
        ties += 1
    return ties


def _check_ubatch(eng: Engine, pred: Predictor, rec: GateInputs) -> tuple[int, int]:
    """(ids compared, near-tie swaps) over every covered target of the last ubatch."""
    spec, d = pred.spec, pred.distance
    n_ids = ties = 0
    for target in range(spec.n_layers):
        if not pred.covers(target):
            continue
        got = eng.predictions(spec.layers[target])
        h = rec.by_layer[spec.layers[target - d]]
        assert got.shape == (h.shape[0], default_n_out(spec.k))
        known = Known(target, d, h, np.zeros(len(h), np.int32), np.full((len(h), spec.k), -1, np.int32))
        ties += _compare(got, pred.scores(known))
        n_ids += got.size
    return n_ids, ties


@pytest.mark.parametrize("kind", ["mlp", "gate", "residual"])
@pytest.mark.parametrize("d", [1, 2])
def test_native_predictions_equal_numpy(fixture_model: Path, kind: str, d: int) -> None:
    preds = _predictors(fixture_model, kind, d)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        targets = eng.set_predictors(preds)
        assert targets == [il for j, il in enumerate(preds[0].spec.layers) if preds[0].covers(j)]
        rec = GateInputs()
        eng.set_policies([rec])
        prompt = eng.tokenize(TEXT)
        assert len(prompt) > 2 * PLAIN["n_ubatch"]
        eng.feed(prompt)  # several ubatches: the last one's ids
        n_ids, ties = _check_ubatch(eng, preds[0], rec)
        eng.feed(prompt[1:PLAIN["n_ubatch"] + 1])  # one full ubatch
        n, t = _check_ubatch(eng, preds[0], rec)
        n_ids, ties = n_ids + n, ties + t
        for _ in range(N_DECODE):
            eng.feed([int(np.argmax(eng.logits()))])
            assert eng.predictions(targets[0]).shape[0] == 1
            n, t = _check_ubatch(eng, preds[0], rec)
            n_ids, ties = n_ids + n, ties + t
    assert ties <= max(2, n_ids // 200), f"{ties} near-tie swaps in {n_ids} ids"


def _logits(eng: Engine, prompt: list[int]) -> list[np.ndarray]:
    """Logits after the prompt and after each of N_DECODE fixed tokens."""
    eng.reset()
    eng.feed(prompt)
    out = [np.ctypeslib.as_array(eng.logits()).copy()]
    for tok in prompt[1:N_DECODE + 1]:
        eng.feed([tok])
        out.append(np.ctypeslib.as_array(eng.logits()).copy())
    return out


@pytest.mark.parametrize("cache", [False, True], ids=["plain", "lru-cache"])
def test_predictors_leave_the_logits_bitwise(fixture_model: Path, cache: bool) -> None:
    """The graph with predictors computes the model exactly as without (also beside the cache's tables)."""
    preds = _predictors(fixture_model, "mlp", 2)
    with Engine(fixture_model, LoadConfig(**PLAIN, use_extra_bufts=False)) as eng:
        if cache:
            eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 2, policy=LruConfig()))
        prompt = eng.tokenize(TEXT)
        ref = _logits(eng, prompt)
        targets = eng.set_predictors(preds)
        got = _logits(eng, prompt)
        ids = eng.predictions(targets[-1])
        eng.set_predictors(None)
        again = _logits(eng, prompt)
    for a, b, c in zip(ref, got, again, strict=False):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert ids.shape == (1, default_n_out(preds[0].spec.k))


def test_predictions_without_a_predictor_and_bad_arguments(fixture_model: Path) -> None:
    preds = _predictors(fixture_model, "mlp", 1)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        il = eng.info.moe_layers[-1]
        assert native._moe_get_predictions(eng.handle.ctx, il, None, 0) == -1
        with pytest.raises(EdgeMoeError, match="no predictor"):
            eng.predictions(il)
        assert eng.predictor_bytes() == 0
        eng.set_predictors(preds)
        assert eng.predictions(il).shape == (0, default_n_out(eng.info.n_expert_used))  # before any decode
        assert eng.predictor_bytes() == device_bytes(preds, n_out=default_n_out(eng.info.n_expert_used))
        eng.set_predictors([])
        assert eng.predictor_bytes() == 0 and native._moe_get_predictions(eng.handle.ctx, il, None, 0) == -1
        # llama.cpp refuses layers and shapes that do not fit
        n_layer, n_expert = eng.info.n_layer, eng.info.n_expert
        f32 = native.GGML_TYPE_F32
        assert native.moe_set_predictor(eng.handle.ctx, 0, n_layer, 1, f32, None, None, None, None, None) == -1
        assert native.moe_set_predictor(eng.handle.ctx, 0, 1, n_expert + 1, f32, None, None, None, None, None) == -1
        i32 = native.GGML_TYPE_I32
        assert native.moe_set_predictor(eng.handle.ctx, 0, 1, 2, i32, None, None, None, None, None) == -1
        with pytest.raises(EdgeMoeError, match="n_out"):
            eng.set_predictors(preds, n_out=n_expert + 1)
        with pytest.raises(EdgeMoeError, match="cannot run inside llama.cpp's graph"):
            eng.set_predictors(_predictors(fixture_model, "first-layer", 1))
        with pytest.raises(EdgeMoeError, match="two predictors"):
            eng.set_predictors(preds + _predictors(fixture_model, "gate", 1))
        with pytest.raises(EdgeMoeError, match="weights"):
            eng.set_predictors(preds, weights="f8")
        assert eng.predictor_targets == []


@pytest.mark.parametrize("weights", ["f16", "q8_0"])
def test_smaller_weight_types_agree_mostly(fixture_model: Path, weights: str) -> None:
    """f16 and q8_0 round the activations as well: the same top-k sets on most tokens, in fewer bytes."""
    preds = _predictors(fixture_model, "mlp", 2)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        k = eng.info.n_expert_used
        rec = GateInputs()
        eng.set_policies([rec])
        eng.set_predictors(preds, weights="f32")
        f32_bytes = eng.predictor_bytes()
        eng.set_predictors(preds, weights=weights)
        assert eng.predictor_bytes() < 0.6 * f32_bytes
        eng.feed(eng.tokenize(TEXT))
        pred, spec = preds[0], preds[0].spec
        hits = total = 0
        for target in range(pred.distance, spec.n_layers):
            got = eng.predictions(spec.layers[target])[:, :k]
            h = rec.by_layer[spec.layers[target - pred.distance]]
            ref = topk_ids(pred.scores(Known(target, 2, h, np.zeros(len(h), np.int32),
                                             np.zeros((len(h), k), np.int32))), k)
            hits += sum(len(set(a) & set(b)) for a, b in zip(got.tolist(), ref.tolist(), strict=False))
            total += ref.size
    assert hits / total >= 0.95, f"{weights}: {hits}/{total} of numpy's top-{k} predicted"


def test_predictor_bytes_count_against_the_vram_budget(fixture_model: Path) -> None:
    info = read_model_info(fixture_model)
    preds = _predictors(fixture_model, "mlp", 2)
    n = device_bytes(preds, n_out=default_n_out(info.n_expert_used))
    # per covered target: w1, w2, skip as F32 and the biases (mlp_hidden(256) = 128)
    n_targets = len(info.moe_layers) - 2
    assert n == n_targets * 4 * (256 * 128 + 128 * info.n_expert + 256 * info.n_expert + 128 + info.n_expert)
    assert device_bytes(preds, n_out=2, weights="f16") < 0.55 * n
    budget = 64 * 2**20
    plain, with_preds = slot_budget(info, budget), slot_budget(info, budget, predictor_bytes=n)
    assert plain.expert_budget_bytes - with_preds.expert_budget_bytes == n
