"""The default adaptive top-k threshold: the most drops within a KL-divergence budget on the validation text,
and the `gating` calibration stage's table of every rule's costs (printed by `edgemoe plan`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.calibration.adaptive import GatingOptions, build_gating, thresholds_cache_path
from edgemoe.calibration.gating_cost import (
    KldBudget,
    ThresholdCost,
    ValidationRun,
    cost_for_budget,
    policy_maker,
)
from edgemoe.calibration.gating_stage import format_gating_quality, gating_quality
from edgemoe.cli import cli
from edgemoe.errors import EdgeMoeError
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.models import FIXTURE_MODELS

ROOT = Path(__file__).resolve().parent.parent
QWEN = next(m for m in FIXTURE_MODELS if "qwen3moe" in m.name)


class _Curve:
    """A stand-in ValidationRun whose cost grows with the share dropped (ser: the threshold itself)."""

    def __init__(self, kld_per_drop: float, top_loss_per_drop: float) -> None:
        self.k, self.t = kld_per_drop, top_loss_per_drop
        self.calls = 0

    def cost(self, policy: GatingPolicy) -> ThresholdCost:
        self.calls += 1
        x = policy.threshold
        return ThresholdCost(x, x, self.k * x, 1.0 - self.t * x, 0.0, 100)


def test_budget_search_takes_the_most_drops_within_both_limits() -> None:
    budget = KldBudget(0.01, 0.97)
    make = policy_maker(GatingRule.SER, None)
    # KLD binds at 0.01 / 0.04 = 0.25; same top at 0.03 / 0.1 = 0.3
    run = _Curve(0.04, 0.1)
    found = cost_for_budget(run, GatingRule.SER, make, budget, None)  # type: ignore[arg-type]
    assert found.threshold == pytest.approx(0.25, abs=1e-3) and budget.allows(found)
    run = _Curve(0.01, 0.2)  # same top binds at 0.15
    assert cost_for_budget(run, GatingRule.SER, make, budget, None).threshold == pytest.approx(0.15, abs=1e-3)  # type: ignore[arg-type]
    run = _Curve(0.001, 0.001)  # everything allowed: the most aggressive threshold, in two measurements
    assert cost_for_budget(run, GatingRule.SER, make, budget, None).threshold == 1.0  # type: ignore[arg-type]
    assert run.calls == 2
    over = _Curve(0.04, 0.1)
    with pytest.raises(EdgeMoeError, match="over the budget"):
        cost_for_budget(over, GatingRule.SER, make, KldBudget(-1.0, 0.97), None)  # type: ignore[arg-type]


def test_default_threshold_is_within_the_budget_and_says_what_it_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "user-cache"))
    cal = tmp_path / "cal"
    shutil.copytree(ROOT / "calibrations" / QWEN.stem, cal)
    (cal / "thresholds.json").unlink()  # search here, not the shipped thresholds
    tokens = np.load(cal / "gating_validation_tokens.npy")[:512]
    np.save(cal / "gating_validation_tokens.npy", tokens)
    with Engine(QWEN, LoadConfig(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2)) as eng:
        pol = build_gating(eng, GatingOptions(mode="ser", calibration=cal))
        assert pol is not None and pol.calibrated is not None
        c = pol.calibrated
        assert c["budget"] == {"max_mean_kld": 0.01, "min_same_top": 0.97}
        assert c["mean_kld"] <= 0.01 and c["same_top"] >= 0.97 and c["validation_reduction"] > 0.02
        run = ValidationRun(eng, tokens.tolist(), ctx=256)
        again = run.cost(GatingPolicy(GatingRule.SER, pol.threshold, decode_only=False))
        assert again.to_dict() == {k: c[k] for k in again.to_dict()}  # the cost is the threshold's, measured
        harder = run.cost(GatingPolicy(GatingRule.SER, pol.threshold + 0.1, decode_only=False))
        assert not KldBudget().allows(harder)  # a threshold dropping more is over the budget
        tight = build_gating(eng, GatingOptions(mode="ser", calibration=cal, budget=KldBudget(0.002, 0.99)))
        assert tight is not None and tight.threshold < pol.threshold
        assert json.loads(thresholds_cache_path(cal).read_text()).keys() == {"ser@kld0.01/top0.97",
                                                                             "ser@kld0.002/top0.99"}


@pytest.mark.long  # every gating rule's quality table: the long suite (`make test-long`)
def test_gating_quality_table_and_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "user-cache"))
    cal = tmp_path / "cal"
    shutil.copytree(ROOT / "calibrations" / QWEN.stem, cal)
    tokens = np.load(cal / "gating_validation_tokens.npy")[:256].tolist()
    with Engine(QWEN, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2)) as eng:
        quality, found = gating_quality(eng, cal, tokens, ctx=128, targets=(0.25,))
    rows = {(r["rule"], r["target"]): r for r in quality["rows"]}
    assert set(rows) == {(m, t) for m in ("fisher", "empirical", "score", "ser") for t in (0.25, None)}
    for m in ("fisher", "empirical", "score", "ser"):
        assert abs(rows[m, 0.25]["validation_reduction"] - 0.25) < 0.03
        assert rows[m, 0.25]["mean_kld"] > 0 and rows[m, 0.25]["same_top"] < 1
        d = rows[m, None]
        assert d["mean_kld"] <= 0.01 and d["same_top"] >= 0.97 and found[f"{m}@kld0.01/top0.97"]["threshold"] == d[
            "threshold"]
    text = format_gating_quality(quality)
    assert "25% target" in text and "default" in text and "mean KLD <= 0.01 and same top >= 97%" in text
    (cal / "gating_quality.json").write_text(json.dumps(quality))
    r = CliRunner().invoke(cli, ["plan", str(QWEN), "--expert-slots", "8", "--calibration", str(cal),
                                 "--profile", "rtx4060-laptop"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "Adaptive top-k (--gating) on the calibration's validation text (256 train-split tokens" in r.output
    r = CliRunner().invoke(cli, ["plan", str(QWEN), "--expert-slots", "8", "--calibration", str(cal), "--json",
                                 "--profile", "rtx4060-laptop"], catch_exceptions=False)
    assert json.loads(r.output)["gating_quality"]["rows"] == quality["rows"]


def test_install_gating_says_what_the_threshold_costs_and_where_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgemoe.placement import install_gating

    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "user-cache"))
    cal = tmp_path / "cal"
    shutil.copytree(ROOT / "calibrations" / QWEN.stem, cal)
    entry = {"threshold": 0.3, "validation_reduction": 0.2, "mean_kld": 0.005, "same_top": 0.975,
             "nll_increase": 0.001, "validation_tokens": 2048, "budget": {"max_mean_kld": 0.01, "min_same_top": 0.97}}
    (cal / "thresholds.json").write_text(json.dumps({"ser@kld0.01/top0.97": entry}))
    said: list[str] = []
    with Engine(QWEN, LoadConfig(n_ctx=128, n_threads=2)) as eng:
        install_gating(eng, GatingOptions(mode="ser", calibration=cal), notify=said.append)
        assert eng.gating_path == "graph" and eng.gating_report()["calibrated"] == entry
        (cal / "super_experts.json").write_text(json.dumps({
            "peaks": {}, "routed": {}, "protected": [[0, 3]], "tokens": 1, "factor": 10.0, "quantile": 99.5,
            "of_max": 0.1}))
        install_gating(eng, GatingOptions(mode="ser", calibration=cal), notify=said.append)
        assert eng.gating_path == "hook" and eng.gating_report()["protected"] == [[0, 3]]
    assert said[0] == ("gating: ser, threshold 0.3, in the graph (prefill at full top-k); KL-divergence budget mean "
                       "KLD <= 0.01 and same top >= 97%: 20.0% fewer expert activations, mean KLD 0.0050, same top "
                       "97.5%, NLL +0.10% on 2048 validation tokens")
    assert "in the routing hook (it protects the calibration's super experts)" in said[1]
