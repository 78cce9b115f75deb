"""The planner: a model, a cache request, a context and a device to one PlacementPlan, before anything loads.

Pure: it reads the GGUF header and the calibration directory, never the native library, and importing it imports
nothing else (the names below load their module on first use). budget and reserve hold the arithmetic (what a
budget holds beside the dense part, the KV cache and the one reserve), context the context table, tiers the context
steps, request the user's cache request and its rules, ubatch the prefill ubatch's protocol, planner plan() itself.
edgemoe.placement opens an engine from a plan; the CLI, serve, bench and simulate share it (docs/expert-cache.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: at run time __getattr__ below imports each on first use
    from .calibration import CalibrationNeed
    from .planner import Device, PlacementPlan, budget_request, check_precalc_from, plan
    from .request import DEFAULT_POLICY, CacheRequest, PlacementError, cache_request, default_policy
    from .reserve import Reserve, reserve_bytes
    from .ubatch import PrefillPricing

_LAZY = {
    "CalibrationNeed": "calibration",
    "Device": "planner",
    "PlacementPlan": "planner",
    "budget_request": "planner",
    "check_precalc_from": "planner",
    "plan": "planner",
    "DEFAULT_POLICY": "request",
    "CacheRequest": "request",
    "PlacementError": "request",
    "cache_request": "request",
    "default_policy": "request",
    "Reserve": "reserve",
    "reserve_bytes": "reserve",
    "PrefillPricing": "ubatch",
}

__all__ = [
    "CacheRequest",
    "CalibrationNeed",
    "DEFAULT_POLICY",
    "Device",
    "PlacementError",
    "PlacementPlan",
    "PrefillPricing",
    "Reserve",
    "budget_request",
    "cache_request",
    "check_precalc_from",
    "default_policy",
    "plan",
    "reserve_bytes",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
