"""Build the adaptive top-k gating policy from user options (--gating, --threshold, --target-reduction).

`fisher` and `empirical` are the AdapMoE sensitivity rule with S_l from the
calibration directory; `score` and `ser` need no calibration. A target
reduction is turned into a threshold on the calibration directory's
validation tokens (never on the text being evaluated); the result is cached
in the per-user cache (thresholds shipped in the directory's thresholds.json are read first).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import EdgeMoeError
from ..policies.gating import GatingPolicy, GatingRule, search_threshold
from .card import cache_dir, write_json
from .sensitivity import VALIDATION_TOKENS, Sensitivity

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
    if (opts.threshold is None) == (opts.target_reduction is None):
        raise EdgeMoeError(f"`gating={opts.mode!r}` needs exactly one of `threshold` or `target_reduction`")
    sens = None
    if rule is GatingRule.SENSITIVITY:
        model = getattr(engine, "path", None)
        sens = Sensitivity.load(_need_calibration(opts, f"`gating={opts.mode!r}`", model)).of(opts.mode)
    threshold = opts.threshold
    if threshold is None:
        threshold = _threshold_for_target(engine, opts, rule, sens, ctx)
    return GatingPolicy(rule, float(threshold), sensitivity=sens, decode_only=opts.decode_only)


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


def _threshold_for_target(
    engine: object, opts: GatingOptions, rule: GatingRule, sens: dict[int, float] | None, ctx: int
) -> float:
    from ..analysis.perplexity import perplexity

    directory = _need_calibration(opts, "`target_reduction`", getattr(engine, "path", None))
    cache_path = thresholds_cache_path(directory)
    # thresholds shipped with the calibration (the bundled fixtures' thresholds.json), then the user's
    cache = {**_read_thresholds(directory / THRESHOLDS), **_read_thresholds(cache_path)}
    key = f"{opts.mode}@{opts.target_reduction:.4f}"
    if key in cache:
        return float(cache[key]["threshold"])
    vpath = directory / VALIDATION_TOKENS
    if not vpath.exists():
        raise EdgeMoeError(f"{directory} has no {VALIDATION_TOKENS}; run `edgemoe calibrate` again")
    tokens = np.load(vpath).tolist()
    if len(tokens) < MIN_VALIDATION_TOKENS:
        raise EdgeMoeError(
            f"{vpath} holds {len(tokens)} tokens, too few to find a threshold for a "
            f"{opts.target_reduction:.0%} reduction (at least {MIN_VALIDATION_TOKENS}): run "
            "`edgemoe calibrate` with a longer corpus, or give a `threshold`"
        )

    def reduction_at(t: float) -> float:
        pol = GatingPolicy(rule, t, sensitivity=sens, decode_only=False)
        return perplexity(engine, tokens, ctx=ctx, policies=[pol]).activation_reduction  # type: ignore[arg-type]

    threshold, reached = search_threshold(rule, float(opts.target_reduction), reduction_at, sens)  # type: ignore[arg-type]
    cache[key] = {"threshold": threshold, "validation_reduction": reached, "validation_tokens": len(tokens)}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path, cache)
    except OSError:  # no writable cache: search again next time
        pass
    return threshold
