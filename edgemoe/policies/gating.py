"""Adaptive top-k gating rules: drop routed experts a token does not need (pure numpy, testable on traces).

Every rule sees a route's top-k weights normalised to sum 1 (``normalised``), in the
router's order (highest first), and never drops the first expert; ``apply_keep`` marks a
dropped slot with id -1 and weight 0 and gives the kept ones the weights the layer's own
rule gives a smaller top-k (renormalised and scaled, or as they are). Rules:

- ``score``: score-based adaptive gating: keep only the top-1 expert when its
  weight alone is at least ``threshold``.
- ``ser`` (ik_llama.cpp's -ser rule): keep expert i > 0 only if p_i > threshold * p_0.
- ``sensitivity`` (AdapMoE, eq. in §4.2): drop experts from the end while the
  perturbation estimate (removed weight mass)^2 * S_l stays <= threshold, S_l being
  layer l's sensitivity. For k = 2 the removed mass is 1 - a (a = top-1 weight),
  which is the paper's (1 - a)^2 * S_l <= T; for k > 2 the mass of all dropped
  experts generalises it.

A GatingPolicy never drops a slot routed to one of its ``protected`` experts (a model's super experts,
edgemoe.policies.protected), whatever the rule says.

An Engine runs these rules inside llama.cpp's graph (ggml_moe_gate, with the
arithmetic of ``normalised``/``keep_mask`` and the model's own weight rule for the kept
experts) unless a Python routing hook or the expert cache needs the routing callback; then
GatingPolicy runs here, in the hook, with the same decisions and the same kept weights (the
route record carries the layer's weight rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from ..errors import EdgeMoeError
from .protected import ProtectedExperts
from .route import RouteRecord, WeightRule


class GatingRule(str, Enum):
    OFF = "off"
    SCORE = "score"
    SER = "ser"
    SENSITIVITY = "sensitivity"


def normalised(weights: np.ndarray, *, logits: bool = False) -> np.ndarray:
    """(n_tokens, k) float64 weights summing to 1 per row: by their sum, or a softmax of logits.

    The arithmetic is the native gate's (ggml_moe_gate): float64, sums in slot order
    (np.cumsum adds sequentially), exp from the C library, so that both decide alike bit for bit.
    """
    x = np.asarray(weights, np.float64)
    if logits:
        x = np.vectorize(math.exp, otypes=[np.float64])(x - x.max(1, keepdims=True))
    total = np.maximum(np.cumsum(x, axis=1)[:, -1:], 1e-30) if x.shape[1] else np.ones((len(x), 1))
    return x / total


def keep_mask(
    rule: GatingRule, weights: np.ndarray, threshold: float, sensitivity: float = 1.0, *, logits: bool = False
) -> np.ndarray:
    """(n_tokens, k) bool: which slots to keep. weights: in the router's order (logits: before the softmax)."""
    t, k = weights.shape
    keep = np.ones((t, k), bool)
    if rule is GatingRule.OFF or k < 2:
        return keep
    w = normalised(weights, logits=logits)
    if rule is GatingRule.SCORE:
        keep[w[:, 0] >= threshold, 1:] = False
    elif rule is GatingRule.SER:
        keep[:, 1:] = w[:, 1:] > threshold * w[:, :1]
    elif rule is GatingRule.SENSITIVITY:
        # removed mass if slots j.. are dropped: suffix sums of w, added from the last slot
        removed = np.cumsum(w[:, ::-1], axis=1)[:, ::-1]  # removed[:, j] = sum(w[:, j:])
        ok = removed * removed * sensitivity <= threshold
        ok[:, 0] = False  # never drop the top-1 expert
        # drop from the end while allowed: slot j dropped iff dropping j.. is allowed
        keep = ~ok
    else:  # pragma: no cover - Enum is closed
        raise ValueError(rule)
    return keep


def apply_keep(route: RouteRecord, keep: np.ndarray) -> None:
    """Drop the slots not kept (id -1, weight 0); the kept weights become what a smaller top-k gives.

    A layer that normalises its selected weights (or takes a softmax over them) gets the kept ones
    renormalised to its scale; a layer that uses the gating outputs as they are keeps them unchanged.
    """
    route.ids[~keep] = -1
    route.weights[~keep] = 0.0
    if route.weight_rule is WeightRule.AS_IS:
        return
    w = route.weights.astype(np.float64)
    total = np.maximum(w.sum(1, keepdims=True), 1e-30)
    route.weights[:] = w / total * route.weight_scale


@dataclass
class GatingPolicy:
    """A route policy applying one rule; per-layer sensitivities for the sensitivity rule."""

    rule: GatingRule
    threshold: float
    sensitivity: Mapping[int, float] | None = None
    decode_only: bool = True  # leave prefill ubatches (more than one token) at full top-k
    wants_probs: bool = False
    wants_gate_inp: bool = False
    n_routed: int = 0  # slots of the routes this policy gated (not those decode_only skipped)
    n_dropped: int = 0  # of these, the slots it dropped
    # experts never dropped (the calibration's super experts); the graph's gate cannot keep them, so an Engine runs
    # a policy that has any in the routing hook
    protected: ProtectedExperts = field(default_factory=ProtectedExperts)
    # what calibration measured the threshold to cost on its validation text (None: a threshold given as is):
    # edgemoe.calibration.gating_cost.ThresholdCost's fields, and the KL-divergence budget that chose it, if one did
    calibrated: Mapping[str, Any] | None = None

    def layer_sensitivity(self, layer: int) -> float:
        return 1.0 if self.sensitivity is None else float(self.sensitivity.get(layer, 1.0))

    def on_route(self, route: RouteRecord) -> None:
        if (
            self.rule is GatingRule.OFF
            or (self.decode_only and route.n_tokens > 1)
            or route.n_expert_used < 2
        ):
            return
        keep = keep_mask(self.rule, route.weights, self.threshold, self.layer_sensitivity(route.layer))
        keep |= self.protected.mask(route.layer, route.ids)
        self.n_routed += keep.size
        self.n_dropped += int((~keep).sum())
        apply_keep(route, keep)

    @property
    def activation_reduction(self) -> float | None:
        """Share of the gated routes' slots dropped so far (None before any)."""
        return self.n_dropped / self.n_routed if self.n_routed else None


# lower score thresholds drop more; higher ser / sensitivity thresholds drop more
_MORE_DROPS_WITH_HIGHER_T = {GatingRule.SCORE: False, GatingRule.SER: True, GatingRule.SENSITIVITY: True}


def drops_more_with_higher_threshold(rule: GatingRule) -> bool:
    """Does a higher threshold drop more experts under `rule` (ser, sensitivity) or fewer (score)?"""
    return _MORE_DROPS_WITH_HIGHER_T[rule]


def bisect_threshold(
    reduction_at: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    *,
    increasing: bool,
    iters: int = 24,
    tol: float = 0.0025,
) -> tuple[float, float]:
    """(threshold, reduction) with reduction_at(threshold) closest to target, for a monotone reduction_at.

    increasing: reduction grows with the threshold. Stops early within tol of the target.
    """
    best = (lo, reduction_at(lo))
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        r = reduction_at(mid)
        if abs(r - target) < abs(best[1] - target):
            best = (mid, r)
        if abs(r - target) <= tol:
            break
        if (r < target) == increasing:
            lo = mid
        else:
            hi = mid
    return best


def threshold_range(rule: GatingRule, sensitivity: Mapping[int, float] | None) -> tuple[float, float]:
    if rule is GatingRule.SENSITIVITY:
        # removed mass <= 1: T >= max S_l drops everything but the top-1 expert everywhere
        return 0.0, max(sensitivity.values()) if sensitivity else 1.0
    return 0.0, 1.0


def search_threshold(
    rule: GatingRule,
    target_reduction: float,
    reduction_at: Callable[[float], float],
    sensitivity: Mapping[int, float] | None = None,
) -> tuple[float, float]:
    """Find the rule's threshold giving `target_reduction` of expert activations (on validation text)."""
    if not 0.0 < target_reduction < 1.0:
        raise EdgeMoeError(f"`target_reduction={target_reduction}` must be between 0 and 1 (e.g. 0.25)")
    lo, hi = threshold_range(rule, sensitivity)
    return bisect_threshold(
        reduction_at, target_reduction, lo, hi, increasing=_MORE_DROPS_WITH_HIGHER_T[rule]
    )
