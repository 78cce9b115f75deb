"""From a model, a budget (or a slot count), a policy and a context to a running engine: the placement planner
that `edgemoe chat/generate/serve`, the tools and Python users share (docs/expert-cache.md). plan() decides the
placement once (PlacementPlan), from the budget arithmetic of edgemoe.placement.budget; open_engine loads it."""

from __future__ import annotations

from .install import (
    assign_costs,
    calibration_for,
    enable_static_placement,
    gating_for,
    install_cache,
    install_gating,
)
from .open import open_engine, this_device
from .planner import CalibrationNeed, Device, PlacementPlan, budget_request, check_precalc_from, plan
from .request import DEFAULT_POLICY, CacheRequest, PlacementError, cache_request, default_policy

__all__ = [
    "DEFAULT_POLICY",
    "CacheRequest",
    "CalibrationNeed",
    "Device",
    "PlacementError",
    "PlacementPlan",
    "assign_costs",
    "budget_request",
    "cache_request",
    "calibration_for",
    "check_precalc_from",
    "default_policy",
    "enable_static_placement",
    "gating_for",
    "install_cache",
    "install_gating",
    "open_engine",
    "plan",
    "this_device",
]
