"""KL divergence and top-token agreement against a base run (edgemoe.analysis.kld, `perplexity --kl-divergence`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.kld import KldComparison, row_kld
from edgemoe.analysis.kld_base import BaseRecorder, KldBase, KldBaseError, RunKey
from edgemoe.cli import cli

from helpers.models import FIXTURE_MODELS

MODEL_ID = {"architecture": "x", "n_layer": 2, "n_embd": 8, "n_expert": 4, "n_vocab": 6, "vocab_sha256": "0"}


def _key(tokens: list[int], ctx: int = 8, score_from: int = 0, **model: object) -> RunKey:
    return RunKey({**MODEL_ID, **model}, ctx, score_from, np.asarray(tokens, np.int32))


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """The exact KL(P || Q) per row, in float64."""
    lp = p_logits - np.log(np.exp(p_logits).sum(1, keepdims=True))
    lq = q_logits - np.log(np.exp(q_logits).sum(1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(1)


def _base(logits: np.ndarray, targets: np.ndarray, top_k: int) -> KldBase:
    rec = BaseRecorder(_key(list(range(10))), top_k=top_k)
    rec(logits, targets)
    return rec.base()


def test_kld_is_exact_with_the_whole_vocabulary_and_a_lower_bound_with_less() -> None:
    rng = np.random.default_rng(0)
    p = rng.normal(size=(50, 6)).astype(np.float32) * 2
    q = p + rng.normal(size=(50, 6)).astype(np.float32)
    targets = rng.integers(0, 6, 50)
    exact = _kl(p.astype(np.float64), q.astype(np.float64))
    whole = row_kld(_base(p, targets, 6), slice(0, 50), q)
    np.testing.assert_allclose(whole, exact, rtol=1e-5, atol=1e-7)  # p stored in float32
    for k in (1, 3, 4):  # two or more tokens merged into one outcome: below the exact KLD
        part = row_kld(_base(p, targets, k), slice(0, 50), q)
        assert (part <= exact + 1e-6).all() and part.mean() < exact.mean() - 1e-3
        assert part.mean() > 0
    np.testing.assert_allclose(row_kld(_base(p, targets, 5), slice(0, 50), q), exact, rtol=1e-5, atol=1e-7)


def test_a_run_against_its_own_base_gives_zero_and_the_same_top() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(40, 6)).astype(np.float32)
    targets = rng.integers(0, 6, 40)
    for k in (2, 6):
        cmp = KldComparison(_base(logits, targets, k))
        cmp(logits[:25], targets[:25])
        cmp(logits[25:], targets[25:])
        res = cmp.result()
        assert res.mean_kld == 0.0 and res.kld_percentiles["max"] == 0.0  # exactly: same arithmetic both sides
        assert res.same_top == 1.0 and res.mean_dp == 0.0 and res.ln_ppl_ratio == 0.0
        assert (res.base_tail_max == 0.0) == (k == 6)


def test_comparison_figures_as_llama_cpp_defines_them() -> None:
    # two rows: the second's top token changes; Δp is q(next) - p(next)
    p = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]))
    q = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.6, 0.2]]))
    targets = np.array([0, 1])
    rec = BaseRecorder(RunKey({**MODEL_ID, "n_vocab": 3}, 8, 0, np.arange(3, dtype=np.int32)), top_k=3)
    rec(p, targets)
    cmp = KldComparison(rec.base())
    cmp(q, targets)
    res = cmp.result()
    assert res.same_top == 0.5
    assert res.mean_kld == pytest.approx(_kl(p, q).mean(), rel=1e-6)
    assert res.mean_dp == pytest.approx(((0.6 - 0.7) + (0.6 - 0.3)) / 2, rel=1e-6)
    assert res.ln_ppl_ratio == pytest.approx((np.log(0.7 / 0.6) + np.log(0.3 / 0.6)) / 2, rel=1e-6)


def test_base_file_round_trip_and_refusals(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(12, 6)).astype(np.float32)
    base = _base(logits, rng.integers(0, 6, 12), 4)
    path = base.save(tmp_path / "b.kld")
    assert path == tmp_path / "b.kld" and not list(tmp_path.glob("*.tmp-*"))
    back = KldBase.load(path)
    assert back.meta == base.meta and np.array_equal(back.ids, base.ids) and np.array_equal(back.logp, base.logp)
    back.check(_key(list(range(10))))
    with pytest.raises(KldBaseError, match="another model"):
        back.check(_key(list(range(10)), architecture="y"))
    with pytest.raises(KldBaseError, match="`ctx=8` `prompt_tokens=0`, this run has `ctx=16`"):
        back.check(_key(list(range(10)), ctx=16))
    with pytest.raises(KldBaseError, match="other tokens"):
        back.check(_key(list(range(1, 11))))
    (tmp_path / "t.txt").write_text("not a base")
    with pytest.raises(KldBaseError, match="is not a KL-divergence base"):
        KldBase.load(tmp_path / "t.txt")
    short = KldComparison(back)
    short(logits[:5], np.zeros(5, np.int64))
    with pytest.raises(KldBaseError, match="scored 5 rows, the base holds 12"):
        short.result()


def _ppl(runner: CliRunner, model: Path, text: Path, *args: str) -> dict:
    res = runner.invoke(cli, ["perplexity", str(model), "--input", str(text), "--ctx", "128", "--max-tokens", "400",
                              "-t", "2", "--json", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_perplexity_kl_divergence_on_the_fixtures(model: Path, tmp_path: Path) -> None:
    """Against itself: KLD 0 and the same top token everywhere; with a gating threshold: KLD > 0; a base of
    another model, context or text is refused in one line."""
    text = tmp_path / "t.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks? It is the east.\n" * 30)
    runner = CliRunner()
    base = tmp_path / "base.kld"
    wrote = _ppl(runner, model, text, "--kl-divergence-base", str(base))
    assert wrote["kld"]["rows"] == wrote["tokens"] > 0 and base.exists()
    same = _ppl(runner, model, text, "--kl-divergence", str(base))["kld"]
    assert same["tokens"] == wrote["tokens"] and same["mean_kld"] == 0.0 and same["same_top"] == 1.0
    assert same["base_tail_max"] == 0.0  # the fixtures' 1024-token vocabulary is kept whole
    gated = _ppl(runner, model, text, "--kl-divergence", str(base), "--gating", "ser", "--threshold", "0.5")
    assert gated["activation_reduction"] > 0.1
    assert gated["kld"]["mean_kld"] > 1e-4 and gated["kld"]["same_top"] < 1.0
    assert gated["kld"]["ln_ppl_ratio"] == pytest.approx(gated["nll"] - wrote["nll"], abs=1e-9)
    other = next(m for m in FIXTURE_MODELS if m != model)
    refusals = {
        "another model": [str(other), "--input", str(text), "--ctx", "128", "--max-tokens", "400"],
        "--ctx 128 --prompt-tokens 0, this run has --ctx 64": [str(model), "--input", str(text), "--ctx", "64",
                                                                "--max-tokens", "400"],
        "other tokens": [str(model), "--input", str(text), "--ctx", "128", "--max-tokens", "300"],
    }
    for why, args in refusals.items():
        res = runner.invoke(cli, ["perplexity", *args, "--kl-divergence", str(base)])
        assert res.exit_code == 1 and why in res.output and len(res.output.strip().splitlines()) == 1, res.output
    res = runner.invoke(cli, ["perplexity", str(model), "--input", str(text), "--kl-divergence", str(base),
                              "--kl-divergence-base", str(tmp_path / "b2.kld")])
    assert res.exit_code == 2 and "not both" in res.output


def test_perplexity_kl_divergence_of_kv_types_degrade_and_precalc(tmp_path: Path) -> None:
    """The options take the run as given: a quantized KV cache, degradation, the pre-calculation (whose rows are
    the decode steps after the prompt), each against the full model's base of the same rows."""
    model = FIXTURE_MODELS[-1]
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return [y * 2 for y in x if y > 0]\n\nclass A:\n    pass\n" * 40)
    runner = CliRunner()
    base = tmp_path / "base.kld"
    _ppl(runner, model, text, "--prompt-tokens", "32", "--kl-divergence-base", str(base))
    kv = _ppl(runner, model, text, "--prompt-tokens", "32", "-ctk", "q4_0", "-ctv", "q4_0", "--flash-attn", "on",
              "--kl-divergence", str(base))["kld"]
    assert kv["mean_kld"] > 0 and kv["base_run"]["cache_type_k"] == "f16"
    deg = _ppl(runner, model, text, "--degrade", "0.5", "--expert-slots", "8", "--kl-divergence", str(base))
    assert deg["degrade"]["replaced"] > 0 and deg["kld"]["mean_kld"] > 0
    pre = _ppl(runner, model, text, "--precalc-from", "5", "--expert-slots", "8", "--prompt-tokens", "32",
               "--kl-divergence", str(base))
    assert pre["kld"]["tokens"] == pre["precalc"]["tokens"] and pre["kld"]["mean_kld"] > 0
    assert pre["precalc"]["top1_agreement"] < 1.0
