"""Build the adaptive top-k gating policy from user options (--gating, --threshold, --target-reduction).

`fisher` and `empirical` are the AdapMoE sensitivity rule with S_l from the
calibration directory; `score` and `ser` need no calibration. Without a threshold,
one is found on the calibration directory's validation tokens (never on the text
being evaluated): the share of activations `target_reduction` asks for, or by default
the most drops within a KL-divergence budget (edgemoe.calibration.gating_cost:
mean KLD <= 0.01 and same top token >= 97% against full top-k). Either way what the
threshold costs there (activations, mean KLD, same top, NLL) goes with the policy
(GatingPolicy.calibrated). Results are cached in the per-user cache (thresholds
shipped in the directory's thresholds.json are read first). The policy protects the
calibration's super experts (edgemoe.calibration.super_experts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeMoeError
from ..policies.gating import GatingPolicy, GatingRule
from ..policies.protected import ProtectedExperts
from .card import cache_dir, write_json
from .gating_cost import (
    KldBudget,
    ThresholdCost,
    ValidationRun,
    cost_for_budget,
    cost_for_target,
    policy_maker,
)
from .sensitivity import VALIDATION_TOKENS, Sensitivity
from .super_experts import protected_experts

MODES = ("off", "fisher", "empirical", "score", "ser")
THRESHOLDS = "thresholds.json"
MIN_VALIDATION_TOKENS = 64  # a target reduction measured on fewer tokens is noise


@dataclass(frozen=True)
class GatingOptions:
    mode: str = "off"  # one of MODES
    threshold: float | None = None
    target_reduction: float | None = None
    calibration: Path | None = None  # directory with sensitivity.json / validation tokens
    decode_only: bool = True  # leave prefill ubatches at full top-k
    budget: KldBudget = KldBudget()  # what the default threshold (no threshold, no target) may cost

    @property
    def rule(self) -> GatingRule:
        if self.mode not in MODES:
            raise EdgeMoeError(f"unknown `gating={self.mode!r}`: use one of {', '.join(MODES)}")
        return {"off": GatingRule.OFF, "score": GatingRule.SCORE, "ser": GatingRule.SER}.get(
            self.mode, GatingRule.SENSITIVITY
        )


def default_calibration_dir(model: Path) -> Path | None:
    """The model's calibration directory (bundled, or the per-user cache), or None when it has none."""
    from .card import CalibrationError, find_calibration

    try:
        return find_calibration(model).path
    except CalibrationError:
        return None


def _need_calibration(opts: GatingOptions, what: str, model: Path | None) -> Path:
    """The calibration directory with the sensitivity stage, checked to be of `model` (same MoE layers and
    expert counts); made on first use (edgemoe.calibration.auto) when the model has none."""
    from .auto import STAGES_FOR, ensure_calibration

    if model is None:
        if opts.calibration is None or not opts.calibration.is_dir():
            raise EdgeMoeError(
                f"{what} needs calibration data: run `edgemoe calibrate MODEL --corpus FILE` "
                "and pass its directory as `calibration`"
            )
        return opts.calibration
    # no engine lent: the sensitivity stage sets gating on the engine it measures, and open_engine's has its
    # expert cache by the time gating is built, so the stage opens its own (docs/architecture.md)
    return ensure_calibration(model, STAGES_FOR["sensitivity"], what, given=opts.calibration)


def build_gating(engine: object, opts: GatingOptions, *, ctx: int = 256) -> GatingPolicy | None:
    """The policy for these options, or None when gating is off."""
    rule = opts.rule
    if rule is GatingRule.OFF:
        return None
    if opts.threshold is not None and opts.target_reduction is not None:
        raise EdgeMoeError(
            f"`gating={opts.mode!r}` takes a `threshold` or a `target_reduction`, not both (neither: the most "
            f"drops within the KL-divergence budget, {opts.budget.describe()})"
        )
    sens = None
    model = getattr(engine, "path", None)
    directory = opts.calibration or (default_calibration_dir(model) if model is not None else None)
    if rule is GatingRule.SENSITIVITY:
        directory = _need_calibration(opts, f"`gating={opts.mode!r}`", model)
        sens = Sensitivity.load(directory).of(opts.mode)
    protected = protected_experts(directory)  # the calibration's super experts, where it has the stage
    threshold, calibrated = opts.threshold, None
    if threshold is None:
        calibrated = _calibrated_threshold(engine, opts, rule, sens, protected, ctx)
        threshold = calibrated["threshold"]
    return GatingPolicy(
        rule,
        float(threshold),
        sensitivity=sens,
        decode_only=opts.decode_only,
        protected=protected,
        calibrated=calibrated,
    )


def thresholds_cache_path(directory: Path) -> Path:
    """Where thresholds found for a calibration directory are cached: the per-user cache, never the
    calibration directory itself (it may be the installed package's, or read-only)."""
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "thresholds" / f"{directory.name}-{digest}.json"


def _read_thresholds(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):  # unreadable or corrupt: search again and overwrite the cache
        return {}


def _validation_tokens(directory: Path, opts: GatingOptions) -> list[int]:
    vpath = directory / VALIDATION_TOKENS
    if not vpath.exists():
        raise EdgeMoeError(f"{directory} has no {VALIDATION_TOKENS}; run `edgemoe calibrate` again")
    tokens = np.load(vpath).tolist()
    if len(tokens) < MIN_VALIDATION_TOKENS:
        raise EdgeMoeError(
            f"{vpath} holds {len(tokens)} tokens, too few to find the `gating={opts.mode!r}` threshold (at least "
            f"{MIN_VALIDATION_TOKENS}): run `edgemoe calibrate` with a longer corpus, or give a `threshold`"
        )
    return tokens


def threshold_key(opts: GatingOptions) -> str:
    """The thresholds.json key of what the options ask for: a target reduction, else the KLD budget."""
    if opts.target_reduction is not None:
        return f"{opts.mode}@{opts.target_reduction:.4f}"
    return f"{opts.mode}@{opts.budget.key}"


def _calibrated_threshold(
    engine: object,
    opts: GatingOptions,
    rule: GatingRule,
    sens: dict[int, float] | None,
    protected: ProtectedExperts,
    ctx: int,
) -> dict[str, Any]:
    """The threshold `opts` asks for (a target reduction, else the KLD budget's) with what it costs on the
    validation tokens: from thresholds.json or the per-user cache, else searched and cached there."""
    directory = _need_calibration(opts, "a gating threshold", getattr(engine, "path", None))
    cache_path = thresholds_cache_path(directory)
    # thresholds shipped with the calibration (the bundled fixtures' thresholds.json), then the user's
    cache = {**_read_thresholds(directory / THRESHOLDS), **_read_thresholds(cache_path)}
    key = threshold_key(opts)
    entry = cache.get(key)
    if entry is not None and ThresholdCost.from_dict(entry) is not None:
        return dict(entry)
    run = ValidationRun(engine, _validation_tokens(directory, opts), ctx=ctx)
    make = policy_maker(rule, sens, protected)
    if entry is not None:  # an entry written before costs were measured: measure its threshold's
        cost = run.cost(make(float(entry["threshold"])))
    elif opts.target_reduction is not None:
        cost = cost_for_target(run, rule, make, float(opts.target_reduction), sens)
    else:
        cost = cost_for_budget(run, rule, make, opts.budget, sens)
    found: dict[str, Any] = cost.to_dict()
    if opts.target_reduction is None:
        found["budget"] = asdict(opts.budget)
    cache[key] = found
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(
            cache_path, {k: v for k, v in cache.items() if k not in _read_thresholds(directory / THRESHOLDS)}
        )
    except OSError:  # no writable cache: search again next time
        pass
    return found


def describe_calibrated(calibrated: Mapping[str, Any]) -> str:
    """What a calibrated threshold costs, in one clause (install_gating's note)."""
    budget = calibrated.get("budget")
    cost = ThresholdCost.from_dict(calibrated)
    said = (
        cost.describe() if cost is not None else f"{calibrated['validation_reduction']:.1%} fewer activations"
    )
    if budget is None:
        return said
    return f"KL-divergence budget {KldBudget(**budget).describe()}: {said}"
