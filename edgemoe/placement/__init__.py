"""From a model, a budget (or a slot count), a policy and a context to a running engine: the placement planner
that `edgemoe chat/generate/serve`, the tools and Python users share (docs/expert-cache.md)."""

from __future__ import annotations

from .install import (
    assign_costs,
    calibration_for,
    check_precalc_from,
    enable_static_placement,
    gating_for,
    install_cache,
    install_gating,
    load_config,
    slots_for,
    whole_model_fits,
)
from .open import open_engine
from .request import DEFAULT_POLICY, CacheRequest, PlacementError, cache_request, default_policy

__all__ = [
    "DEFAULT_POLICY",
    "CacheRequest",
    "PlacementError",
    "assign_costs",
    "cache_request",
    "calibration_for",
    "check_precalc_from",
    "default_policy",
    "enable_static_placement",
    "gating_for",
    "install_cache",
    "install_gating",
    "load_config",
    "open_engine",
    "slots_for",
    "whole_model_fits",
]
