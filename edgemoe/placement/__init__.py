"""From a model and a plan to a running engine: open_engine loads what edgemoe.plan.plan() decided and installs
its expert cache (first-use calibration on that engine, the allocation across layers, the policy's record, the
assigner's costs) and adaptive top-k (docs/expert-cache.md).

The planner's own names (plan, CacheRequest, cache_request, PlacementError, ...) live in edgemoe.plan; they are
reachable here too, as they were. Importing this package imports nothing: each name loads its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: at run time __getattr__ below imports each on first use
    from ..plan.calibration import CalibrationNeed
    from ..plan.planner import Device, PlacementPlan, budget_request, check_precalc_from, plan
    from ..plan.request import DEFAULT_POLICY, CacheRequest, PlacementError, cache_request, default_policy
    from .install import (
        assign_costs,
        calibration_for,
        enable_static_placement,
        gating_for,
        install_cache,
        install_gating,
    )
    from .open import open_engine, this_device

_LAZY = {
    "assign_costs": ".install",
    "calibration_for": ".install",
    "enable_static_placement": ".install",
    "gating_for": ".install",
    "install_cache": ".install",
    "install_gating": ".install",
    "open_engine": ".open",
    "this_device": ".open",
    "CalibrationNeed": "..plan.calibration",
    "Device": "..plan.planner",
    "PlacementPlan": "..plan.planner",
    "budget_request": "..plan.planner",
    "check_precalc_from": "..plan.planner",
    "plan": "..plan.planner",
    "DEFAULT_POLICY": "..plan.request",
    "CacheRequest": "..plan.request",
    "PlacementError": "..plan.request",
    "cache_request": "..plan.request",
    "default_policy": "..plan.request",
}

__all__ = [
    "CacheRequest",
    "CalibrationNeed",
    "DEFAULT_POLICY",
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
