"""Sensitivity calibration (Fisher via the torch reference, empirical via the hook) and gating setup."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgemoe.calibration.adaptive import GatingOptions, build_gating
from edgemoe.calibration.sensitivity import (
    Sensitivity,
    calibrate_sensitivity,
    save_validation_tokens,
    spearman,
)
from edgemoe.errors import EdgeMoeError, UnsupportedArchitectureError
from edgemoe.policies.gating import GatingRule
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.torchref.gguf_import import load_gguf_model

from helpers.models import FIXTURE_MODELS

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nThe list type is a mutable sequence.\n" * 12


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_gguf_import_matches_llama_cpp(model: Path) -> None:
    torch.set_num_threads(1)
    ref = load_gguf_model(model)
    with Engine(model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        ids = eng.tokenize(TEXT)[:64]
        got = np.array(eng.eval_logits(ids))
    with torch.no_grad():
        want = ref(torch.tensor([ids]))[0][0].numpy()
    # llama.cpp quantizes activations for its matmuls; the reference uses the dequantized weights in f32
    assert ((got - want) ** 2).mean() / (want ** 2).mean() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_import_refuses_other_architectures(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedArchitectureError, match="empirical"):
        load_gguf_model(make_tiny_gguf("tiny-qwen2moe"))


def test_calibrate_and_round_trip(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = FIXTURE_MODELS[-1]
    with Engine(model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        toks = eng.tokenize(TEXT, add_special=False)[:256]
        s = calibrate_sensitivity(model, eng, toks, ctx=128)
        layers = list(eng.info.moe_layers)
    assert sorted(s.empirical) == layers and sorted(s.fisher) == layers
    assert all(v > 0 for v in s.fisher.values())
    assert all(np.isfinite(list(s.empirical.values())))
    assert -1.0 <= s.spearman <= 1.0 and s.tokens > 0
    s.save(tmp_path)
    assert Sensitivity.load(tmp_path) == s


def test_spearman() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_build_gating_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemoe.calibration.adaptive import thresholds_cache_path

    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "user-cache"))
    model = FIXTURE_MODELS[-1]
    with Engine(model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        assert build_gating(eng, GatingOptions()) is None
        with pytest.raises(EdgeMoeError, match="not both"):
            build_gating(eng, GatingOptions(mode="score", threshold=0.5, target_reduction=0.25))
        # no --calibration: the model's own (the fixture's bundled one; a model without one is calibrated on
        # first use, tests/test_auto_calibration.py)
        fisher = build_gating(eng, GatingOptions(mode="fisher", threshold=0.1))
        assert fisher is not None and fisher.rule is GatingRule.SENSITIVITY
        pol = build_gating(eng, GatingOptions(mode="ser", threshold=0.3))
        assert pol is not None and pol.rule is GatingRule.SER and pol.decode_only
        # a target reduction: searched on the calibration's validation tokens, then cached
        s = Sensitivity(empirical={il: 0.01 * (il + 1) for il in eng.info.moe_layers},
                        fisher={il: 1.0 for il in eng.info.moe_layers}, base_nll=3.0, tokens=10, spearman=None)
        s.save(tmp_path)
        save_validation_tokens(tmp_path, eng.tokenize(TEXT, add_special=False)[:200])
        from edgemoe.calibration.card import CARD, FORMAT_VERSION, write_json
        from edgemoe.calibration.run import _model_entry

        write_json(tmp_path / CARD, {"format": FORMAT_VERSION, "model": _model_entry(model)})  # of this model
        opts = GatingOptions(mode="empirical", target_reduction=0.25, calibration=tmp_path, decode_only=False)
        pol = build_gating(eng, opts)
        from edgemoe.analysis.perplexity import perplexity

        red = perplexity(eng, np.load(tmp_path / "gating_validation_tokens.npy").tolist(), ctx=128,
                         policies=[pol]).activation_reduction
        assert abs(red - 0.25) < 0.03
        # cached for the user, never written into the calibration directory (it may be the installed package's)
        assert not (tmp_path / "thresholds.json").exists()
        assert thresholds_cache_path(tmp_path).is_relative_to(tmp_path / "user-cache")
        assert thresholds_cache_path(tmp_path).exists()
        assert build_gating(eng, opts).threshold == pol.threshold  # from the cache
        assert pol.calibrated is not None and abs(pol.calibrated["validation_reduction"] - red) < 0.03
        assert 0 < pol.calibrated["mean_kld"] and 0 < pol.calibrated["same_top"] < 1  # what it costs, measured
