"""The MoE routing hook and the expert cache of an Engine: which policies see each routing.

RoutingMixin is a part of Engine (edgemoe.runtime.engine). The user's policies run first, then
the expert-cache controller when its residency policy needs the routes; one HookChain serves all.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..gguf.info import ModelInfo
from ..policies.residency import make_policy
from ..policies.route import RoutePolicy
from . import native
from .expert_cache import CacheConfig, CacheController, ExpertCache
from .hooks import HookChain


class RoutingMixin:
    """set_policies() / enable_expert_cache() of Engine."""

    _ctx: Any
    path: Path
    info: ModelInfo
    _hooks: HookChain | None
    _policies: list[RoutePolicy]
    cache: CacheController | None

    def set_policies(self, policies: Sequence[RoutePolicy] | None) -> HookChain | None:
        """Route every MoE layer of every ubatch through these policies (None or [] removes the hook)."""
        self._policies = list(policies or [])
        chain = self._policies + ([self.cache] if self.cache is not None and self.cache.needs_routes else [])
        if chain:
            self._hooks = HookChain(chain)
            native.moe_set_hook(self._ctx, self._hooks.c_callback, self._hooks.flags)
        else:
            native.moe_set_hook(self._ctx, None, 0)
            self._hooks = None
        return self._hooks

    def enable_expert_cache(self, config: CacheConfig | None, *, device: object = None) -> ExpertCache | None:
        """Give every MoE layer config.slots_per_layer expert slots run by config.policy (None removes it).

        device None uses the CPU buffer that stands in for a GPU (the split logic without one).
        """
        if self.cache is not None:
            self.cache.cache.close()
            self.cache = None
        if config is not None:
            policy = make_policy(config.policy, {il: config.slots_per_layer for il in self.info.moe_layers},
                                 blocking=config.blocking, calibration=config.calibration)
            cache = ExpertCache(self._ctx, self.path, list(self.info.moe_layers), self.info.n_layer,
                                self.info.n_expert, config.slots_per_layer, device)
            try:
                self.cache = CacheController(cache, policy)
            except BaseException:
                cache.close()
                raise
        self.set_policies(self._policies)
        return self.cache.cache if self.cache is not None else None
