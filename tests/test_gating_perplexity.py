"""Adaptive top-k rules on hand-made routes, and perplexity through edgemoe vs stock llama.cpp."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.perplexity import chunk_tokens, log_softmax_nll, perplexity
from edgemoe.cli import cli
from edgemoe.policies.gating import GatingPolicy, GatingRule, apply_keep, keep_mask
from edgemoe.policies.route import RouteRecord, WeightRule
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.models import FIXTURE_MODELS

W = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.5, 0.5, 0.0]], np.float32)


def test_score_rule() -> None:
    keep = keep_mask(GatingRule.SCORE, W, 0.5)
    assert keep.tolist() == [[True, False, False], [True, True, True], [True, False, False]]


def test_ser_rule() -> None:
    keep = keep_mask(GatingRule.SER, W, 0.5)  # keep p_i > 0.5 * p_0
    assert keep.tolist() == [[True, False, False], [True, True, True], [True, True, False]]


def test_sensitivity_rule_k2_is_the_paper_rule() -> None:
    w = np.array([[0.9, 0.1], [0.6, 0.4]], np.float32)
    # (1 - a)^2 * S <= T drops the second expert: 0.01 * 2 = 0.02 <= 0.05; 0.16 * 2 = 0.32 > 0.05
    assert keep_mask(GatingRule.SENSITIVITY, w, 0.05, sensitivity=2.0).tolist() == [[True, False], [True, True]]


def test_sensitivity_rule_drops_from_the_end() -> None:
    w = np.array([[0.6, 0.25, 0.1, 0.05]], np.float32)
    # removed mass if dropping from slot j: [1.0, 0.4, 0.15, 0.05]; squared: [1, .16, .0225, .0025]
    assert keep_mask(GatingRule.SENSITIVITY, w, 0.03).tolist() == [[True, True, False, False]]
    assert keep_mask(GatingRule.SENSITIVITY, w, 10.0).tolist() == [[True, False, False, False]]  # never the top-1
    assert keep_mask(GatingRule.SENSITIVITY, w, 0.001).all()


def test_apply_keep_renormalises() -> None:
    ids = np.array([[3, 1, 2]], np.int32)
    w = np.array([[0.5, 0.3, 0.2]], np.float32)
    r = RouteRecord(layer=0, ids=ids, weights=w, probs=None, gate_inp=None, n_expert=4)
    apply_keep(r, np.array([[True, True, False]]))
    assert ids.tolist() == [[3, 1, -1]]
    np.testing.assert_allclose(w, [[0.625, 0.375, 0.0]])


def test_apply_keep_follows_the_layers_weight_rule() -> None:
    def kept(rule: WeightRule, scale: float) -> list[float]:
        w = np.array([[0.5, 0.3, 0.2]], np.float32)
        r = RouteRecord(0, np.array([[3, 1, 2]], np.int32), w, None, None, 4, weight_rule=rule, weight_scale=scale)
        apply_keep(r, np.array([[True, True, False]]))
        return w[0].tolist()

    np.testing.assert_allclose(kept(WeightRule.AS_IS, 1.0), [0.5, 0.3, 0.0])  # qwen2moe, olmoe: as they are
    np.testing.assert_allclose(kept(WeightRule.NORM, 2.5), [1.5625, 0.9375, 0.0])  # normalised, then scaled
    np.testing.assert_allclose(kept(WeightRule.SOFTMAX, 1.0), [0.625, 0.375, 0.0])  # softmax over the kept


def test_policy_leaves_prefill_alone_by_default() -> None:
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.array([[0.9, 0.1], [0.9, 0.1]], np.float32)
    GatingPolicy(GatingRule.SCORE, 0.5).on_route(RouteRecord(0, ids, w, None, None, 4))
    assert (ids >= 0).all()
    GatingPolicy(GatingRule.SCORE, 0.5, decode_only=False).on_route(RouteRecord(0, ids, w, None, None, 4))
    assert ids[:, 1].tolist() == [-1, -1]


def test_chunks_and_nll() -> None:
    assert chunk_tokens(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunk_tokens(list(range(7)), 4, 99) == [[99, 0, 1, 2], [99, 3, 4, 5]]  # a lone last token is not scored
    logits = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    assert math.isclose(log_softmax_nll(logits, np.array([0, 1])), -math.log(0.5) - math.log(0.1))


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_perplexity_off_equals_stock(model: Path) -> None:
    import llama_cpp

    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20)
    with Engine(model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        toks = eng.tokenize(text, add_special=False)[:300]
        res = perplexity(eng, toks, ctx=128)
        bos = eng.bos_token() if eng.adds_bos() else None
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=128, n_batch=128, logits_all=True, flash_attn=True,
                          verbose=False)  # the Engine's "auto" resolves to on here
    nll, n = 0.0, 0
    for c in chunk_tokens(toks, 128, bos):
        llm.reset()
        llm.eval(c)
        nll += log_softmax_nll(np.array(llm.scores[:len(c) - 1]), np.array(c[1:]))
        n += len(c) - 1
    llm.close()
    assert res.tokens == n and res.nll == pytest.approx(nll / n, rel=1e-12)
    assert res.activation_reduction == 0.0 and res.expert_activations == res.full_activations > 0


def test_gating_reduces_activations_and_counts_them() -> None:
    model = FIXTURE_MODELS[-1]
    text = "The list type is a mutable sequence. To be, or not to be, that is the question.\n" * 10
    with Engine(model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        toks = eng.tokenize(text, add_special=False)[:200]
        full = perplexity(eng, toks, ctx=128)
        gated = perplexity(eng, toks, ctx=128, policies=[GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False)])
    k = eng.info.n_expert_used
    # threshold 0: every token keeps only its top-1 expert
    assert gated.expert_activations * k == full.full_activations
    assert gated.activation_reduction == pytest.approx(1 - 1 / k)
    assert gated.nll > full.nll


def test_perplexity_cli(tmp_path: Path) -> None:
    inp = tmp_path / "t.txt"
    inp.write_text("To be, or not to be, that is the question.\n" * 30)
    r = CliRunner().invoke(cli, ["perplexity", str(FIXTURE_MODELS[0]), "--input", str(inp), "--ctx", "128",
                                 "--gating", "ser", "--threshold", "0.5", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["ppl"] > 1 and 0 < d["activation_reduction"] < 1 and d["tokens"] > 0
    r = CliRunner().invoke(cli, ["perplexity", str(FIXTURE_MODELS[0]), "--input", str(inp), "--gating", "score",
                                 "--threshold", "0.5", "--target-reduction", "0.25"])
    assert r.exit_code != 0 and "takes a --threshold or a --target-reduction, not both" in r.output


def test_bisect_threshold_on_toy_curves() -> None:
    from edgemoe.policies.gating import bisect_threshold, search_threshold

    calls = []

    def rising(t: float) -> float:  # reduction = t^2
        calls.append(t)
        return t * t

    t, r = bisect_threshold(rising, 0.25, 0.0, 1.0, increasing=True)
    assert abs(t - 0.5) < 0.01 and abs(r - 0.25) <= 0.0025 and len(calls) < 26
    t, r = bisect_threshold(lambda t: 1 - t, 0.3, 0.0, 1.0, increasing=False)
    assert abs(t - 0.7) < 0.01
    # a step function: the closest reachable value is returned
    t, r = bisect_threshold(lambda t: 0.0 if t < 0.6 else 0.5, 0.25, 0.0, 1.0, increasing=True)
    assert r in (0.0, 0.5)
    # the rule decides the direction and the range
    t, r = search_threshold(GatingRule.SCORE, 0.4, lambda t: 1 - t)
    assert abs(t - 0.6) < 0.01
    t, r = search_threshold(GatingRule.SENSITIVITY, 0.5, lambda t: t / 4.0, sensitivity={0: 4.0, 1: 1.0})
    assert abs(t - 2.0) < 0.02
    with pytest.raises(Exception, match="between 0 and 1"):
        search_threshold(GatingRule.SER, 1.5, lambda t: t)
