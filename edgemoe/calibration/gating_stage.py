"""Calibration stage `gating` (optional): every adaptive top-k rule's thresholds and what each costs.

For each rule (fisher and empirical where the sensitivity stage has them, score, ser), on the validation tokens
of the sensitivity stage (train-split text): the threshold giving 10%, 25% and 40% fewer expert activations and
the default one, the most drops within the KL-divergence budget (edgemoe.calibration.gating_cost), each with its
mean KLD, same-top rate and NLL change against full top-k. Writes gating_quality.json (what `edgemoe plan`
prints) and adds the thresholds to thresholds.json, so `--gating RULE` with `--target-reduction` 0.1/0.25/0.4 or
no threshold at all needs no search. Optional (`edgemoe calibrate --stage gating`): it runs the model about 150
times over the validation tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EdgeMoeError
from ..policies.gating import GatingRule
from .gating_cost import KldBudget, ValidationRun, cost_for_budget, cost_for_target, policy_maker
from .sensitivity import VALIDATION_TOKENS, Sensitivity
from .super_experts import protected_experts

if TYPE_CHECKING:
    from .stages import StageContext

FILE_NAME = "gating_quality.json"
THRESHOLDS = "thresholds.json"  # edgemoe.calibration.adaptive.THRESHOLDS
TARGETS = (0.1, 0.25, 0.4)


def _rules(sens: Sensitivity) -> dict[str, tuple[GatingRule, dict[int, float] | None]]:
    rules: dict[str, tuple[GatingRule, dict[int, float] | None]] = {}
    if sens.fisher is not None:
        rules["fisher"] = (GatingRule.SENSITIVITY, sens.fisher)
    rules["empirical"] = (GatingRule.SENSITIVITY, sens.empirical)
    rules["score"] = (GatingRule.SCORE, None)
    rules["ser"] = (GatingRule.SER, None)
    return rules


def gating_quality(
    engine: Any,
    directory: Path,
    tokens: Sequence[int],
    *,
    ctx: int = 256,
    targets: Sequence[float] = TARGETS,
    budget: KldBudget | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(gating_quality.json's contents, the thresholds.json entries) for the calibration in `directory`."""
    budget = budget or KldBudget()
    run = ValidationRun(engine, tokens, ctx=ctx)
    protected = protected_experts(directory)
    rows: list[dict[str, Any]] = []
    thresholds: dict[str, Any] = {}
    for mode, (rule, sens) in _rules(Sensitivity.load(directory)).items():
        make = policy_maker(rule, sens, protected)
        for target in targets:
            cost = cost_for_target(run, rule, make, target, sens)
            rows.append({"rule": mode, "target": target, **cost.to_dict()})
            thresholds[f"{mode}@{target:.4f}"] = cost.to_dict()
        try:
            cost = cost_for_budget(run, rule, make, budget, sens)
        except EdgeMoeError:  # over the budget at its mildest: no default for this rule
            rows.append({"rule": mode, "target": None, "threshold": None})
            continue
        rows.append({"rule": mode, "target": None, **cost.to_dict()})
        thresholds[f"{mode}@{budget.key}"] = {**cost.to_dict(), "budget": asdict(budget)}
    quality = {
        "validation_tokens": len(tokens),
        "ctx": ctx,
        "budget": asdict(budget),
        "protected": protected.to_list(),
        "rows": rows,
    }
    return quality, thresholds


def gating_stage(ctx: StageContext) -> dict[str, Any]:
    """Calibration stage `gating`: gating_quality.json and thresholds.json. Options (ctx.options["gating"]):
    ctx (chunk length, default the sensitivity stage's, 256), max_mean_kld, min_same_top (the budget)."""
    from .card import write_json

    opts = ctx.options.get("gating", {})
    chunk = int(opts.get("ctx", ctx.card.get("sensitivity", {}).get("ctx", 256)))
    budget = KldBudget(
        float(opts.get("max_mean_kld", KldBudget.max_mean_kld)),
        float(opts.get("min_same_top", KldBudget.min_same_top)),
    )
    tokens = np.load(ctx.out_dir / VALIDATION_TOKENS).tolist()
    with ctx.open_engine() as eng:
        quality, found = gating_quality(eng, ctx.out_dir, tokens, ctx=chunk, budget=budget)
    write_json(ctx.out_dir / FILE_NAME, quality)
    path = ctx.out_dir / THRESHOLDS
    shipped = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, {**shipped, **found})
    defaults = {r["rule"]: r for r in quality["rows"] if r["target"] is None}
    return {
        "files": [FILE_NAME, THRESHOLDS],
        "validation_tokens": len(tokens),
        "budget": quality["budget"],
        "default": defaults,
    }


def load_gating_quality(directory: Path | None) -> dict[str, Any] | None:
    """A calibration's gating_quality.json (None: it has none)."""
    if directory is None or not (directory / FILE_NAME).exists():
        return None
    return json.loads((directory / FILE_NAME).read_text())  # type: ignore[no-any-return]


def format_gating_quality(quality: Mapping[str, Any]) -> str:
    """The table `edgemoe plan` prints: per rule, each target's and the default's cost."""
    b = KldBudget(**quality["budget"])
    lines = [
        f"Adaptive top-k (`gating`) on the calibration's validation text ({quality['validation_tokens']} train-split "
        "tokens, every token gated), against full top-k:",
        f"  {'rule':<10} {'threshold':<16} {'fewer activations':>17} {'NLL':>8} {'mean KLD':>9} {'same top':>9}",
    ]
    for r in quality["rows"]:
        name = f"{r['target']:.0%} target" if r["target"] is not None else "default"
        if r.get("threshold") is None:
            lines.append(f"  {r['rule']:<10} {name:<16} {'over the budget at its mildest threshold':>46}")
            continue
        lines.append(
            f"  {r['rule']:<10} {name:<16} {r['validation_reduction']:>17.1%} {r['nll_increase']:>+8.2%} "
            f"{r['mean_kld']:>9.4f} {r['same_top']:>9.1%}"
        )
    lines.append(
        f"default: the most drops within {b.describe()} (what `gating=RULE` without `threshold` or "
        "`target_reduction` runs)"
    )
    if quality.get("protected"):
        lines.append(f"never dropped (super experts, layer/expert): {quality['protected']}")
    return "\n".join(lines)
