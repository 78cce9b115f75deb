"""The MoE routing hook, adaptive top-k and the expert cache of an Engine: who decides each routing.

RoutingMixin is a part of Engine (edgemoe.runtime.engine). Adaptive top-k and the expert cache's
residency (expert-to-slot tables, the lru, dali and daop policies) run inside llama.cpp's graph, with no host
round trip per MoE layer, while nothing needs the routing callback. A Python policy (or lru or dali with
blocking loads, promoe, dali's prefetcher) needs it: then gating runs first in the hook chain, then the
user's policies, then the expert-cache controller when its residency policy needs the routes; one
HookChain serves all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import EdgeMoeError
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo
from ..policies.assignment import make_assigner
from ..policies.degrade import GracefulDegradation
from ..policies.gating import GatingPolicy, GatingRule
from ..policies.miss_assignment import AssignedPolicy
from ..policies.promoe import PromoePolicy
from ..policies.registry import NativeStep, PolicyInputs, spec_of
from ..policies.residency import ResidencyPolicy
from ..policies.route import RoutePolicy
from . import native
from .cache_config import CacheConfig, PolicyConfig
from .expert_cache import CacheController, CacheResidency, ExpertCache
from .hooks import HookChain
from .prefetcher import NativePromoeController, make_prefetcher

log = logging.getLogger(__name__)


def assigned(policy: ResidencyPolicy, config: PolicyConfig) -> ResidencyPolicy | AssignedPolicy:
    """`policy` under the CPU/GPU assigner `config` names (unchanged without one); the config records refuse the
    policies an assigner cannot act on."""
    assignment = config.assignment()
    if assignment is None:
        return policy
    assign, costs = assignment
    if not costs:
        raise EdgeMoeError(
            "--assign needs a cost model: a machine profile with a GPU (--profile NAME or FILE; "
            "`edgemoe profile` measures this machine's)"
        )
    return AssignedPolicy(policy, dict(costs), make_assigner(assign), name=assign)


def residency_policy(config: PolicyConfig, slots: dict[int, int], n_expert: int) -> ResidencyPolicy:
    """The residency policy `config` describes over `slots` (layer -> slots), built by its spec; the prefetchers
    are built by edgemoe.runtime.prefetcher instead."""
    return spec_of(config).build(config, PolicyInputs(slots, n_expert))


def residency_run(
    config: PolicyConfig, slots: dict[int, int], n_expert: int
) -> tuple[ResidencyPolicy | AssignedPolicy, NativeStep | None]:
    """The residency policy `config` describes (under its assigner, if any) and the native step that runs it in the
    graph (None: only the routing hook can: blocking loads, an assigner)."""
    spec = spec_of(config)
    base = residency_policy(config, slots, n_expert)
    policy = assigned(base, config)
    return policy, spec.native(config, base) if spec.native is not None and policy is base else None


_NATIVE_RULE = {
    GatingRule.SCORE: native.MOE_GATING_SCORE,
    GatingRule.SER: native.MOE_GATING_SER,
    GatingRule.SENSITIVITY: native.MOE_GATING_SENSITIVITY,
}


class RoutingMixin:
    """set_policies() / enable_expert_cache() of Engine."""

    _ctx: Any
    path: Path
    header: GgufHeader
    info: ModelInfo
    _hooks: HookChain | None
    _policies: list[RoutePolicy]
    cache: CacheController | None
    _gating: GatingPolicy | None
    set_predictors: Any  # PredictionMixin's

    def set_policies(self, policies: Sequence[RoutePolicy] | None) -> HookChain | None:
        """Route every MoE layer of every ubatch through these policies (None or [] removes the hook)."""
        self._policies = list(policies or [])
        callback = self._needs_callback()
        if self.cache is not None:
            self.cache.set_mode(native.MOE_CACHE_POLICY_CALLBACK if callback else self.cache.native_policy)
        hook_gating = self._gating is not None and callback
        degrade = self.cache.degradation if self.cache is not None else None
        chain = (
            ([self._gating] if hook_gating and self._gating is not None else [])
            + self._policies
            + ([degrade] if degrade else [])
            + ([self.cache] if callback and self.cache is not None and self.cache.needs_routes else [])
        )
        self._set_native_gating(None if hook_gating else self._gating)
        if chain:
            hooks = HookChain(chain)
            native.moe_set_hook(self._ctx, hooks.c_callback, hooks.flags)
            self._hooks = hooks  # the old chain's C callback is freed only once llama.cpp holds the new one
        else:
            native.moe_set_hook(self._ctx, None, 0)
            self._hooks = None
        return self._hooks

    def _needs_callback(self) -> bool:
        """Does anything need the routing callback: a Python policy, or an expert-cache policy that runs
        in it (blocking loads, dali)?"""
        # native promoe maps the cached layers' ids in the callback, where gating must run too (the graph's
        # gating leaves layers the callback maps alone)
        return bool(self._policies) or (
            self.cache is not None
            and (
                self.cache.native_policy == native.MOE_CACHE_POLICY_CALLBACK
                or self.cache.degradation is not None
                or (
                    self._gating is not None
                    and self.cache.native_policy == native.MOE_CACHE_POLICY_PREDICTED_PREFETCH
                )
            )
        )

    def _set_native_gating(self, policy: GatingPolicy | None) -> None:
        """The gating llama.cpp applies in the graph (None: none; an unchanged setting keeps the graph)."""
        if policy is None:
            native.moe_set_gating(self._ctx, native.MOE_GATING_NONE, 0.0, None, True)
            return
        sens = [policy.layer_sensitivity(il) for il in range(self.info.n_layer)]
        if (
            native.moe_set_gating(
                self._ctx, _NATIVE_RULE[policy.rule], policy.threshold, sens, policy.decode_only
            )
            != 0
        ):
            raise EdgeMoeError(
                f"llama.cpp refused the gating rule {policy.rule.value} with threshold "
                f"{policy.threshold}: {native.recent_log()[-200:].strip()}"
            )

    @property
    def gating_path(self) -> str | None:
        """Where adaptive top-k runs: "graph" (inside llama.cpp), "hook" (the Python callback) or None."""
        if self._gating is None:
            return None
        return "hook" if self._needs_callback() else "graph"

    def set_gating(self, policy: GatingPolicy | None) -> str | None:
        """Adaptive top-k on every MoE layer (None turns it off); returns where it runs (gating_path).

        In the graph the decisions equal ``policy``'s and the kept weights follow the model's own rule;
        while the user's policies or the expert cache's blocking loads need the routing callback,
        ``policy`` runs there (same decisions, same kept weights).
        """
        self._gating = policy if policy is not None and policy.rule is not GatingRule.OFF else None
        self.reset_control_stats()
        self.set_policies(self._policies)
        return self.gating_path

    def gating_report(self) -> dict[str, Any] | None:
        """{"rule", "threshold", "path", "activation_reduction"} of the gated routes so far, or None."""
        g = self._gating
        if g is None:
            return None
        if self.gating_path == "graph":
            st = native.moe_stats(self._ctx)
            reduction = st["n_dropped"] / st["n_routed"] if st["n_routed"] else None
        else:
            reduction = g.activation_reduction
        return {
            "rule": g.rule.value,
            "threshold": g.threshold,
            "path": self.gating_path,
            "activation_reduction": reduction,
        }

    def control_stats(self) -> dict[str, int]:
        """What the MoE control path did: ubatches, host syncs of the routing callback, slots gated in the graph,
        device splits overlapped with the CPU."""
        return native.moe_stats(self._ctx)

    def set_ids_check(self, on: bool = True) -> None:
        """Check every id row this engine hands a device's mul_mat_id / add_id (a GPU's, or the RPC stand-in's):
        only valid, distinct ids per token (docs/architecture.md, "Id rows on a device"). Slow: tests and doctor;
        EDGEMOE_CHECK_IDS=1 turns it on for every Engine."""
        native.moe_set_ids_check(self._ctx, on)

    def ids_check(self) -> dict[str, int | str]:
        """The checker's counts since set_ids_check(): nodes and rows checked, rows with a negative, out-of-range or
        repeated id, and the first failing node and row."""
        return native.moe_ids_check(self._ctx)

    def reset_control_stats(self) -> None:
        """Zero control_stats() and the gating counters (the graph is kept)."""
        native.moe_reset_stats(self._ctx)
        if self._gating is not None:
            self._gating.n_routed = self._gating.n_dropped = 0

    def enable_expert_cache(self, config: CacheConfig | None, *, device: object = None) -> ExpertCache | None:
        """Give the MoE layers config.slots_per_layer expert slots run by config.policy (None removes it).

        device None uses the CPU buffer that stands in for a GPU (the split logic without one). The promoe
        policy (ProMoE's prefetcher) runs inside llama.cpp with the calibration's predictor in the graph (it
        replaces the predictors set with set_predictors), or in the routing hook where it cannot.
        """
        if self.cache is not None:
            if isinstance(self.cache, NativePromoeController):
                self.set_predictors(None)
            self.cache.cache.close()
            self.cache = None
        if config is not None:
            slots = config.slots(list(self.info.moe_layers), self.info.n_expert)
            run = None if config.prefetcher else residency_run(config.policy, slots, self.info.n_expert)
            cache = ExpertCache(
                self._ctx,
                self.header,
                list(self.info.moe_layers),
                self.info.n_layer,
                self.info.n_expert,
                slots,
                device,
            )
            overlap = config.overlap_on(os.environ)
            if config.overlap and not overlap:
                log.warning(
                    "GGML_CUDA_GRAPH_OPT=1: the expert cache's CPU/GPU overlap is off (llama.cpp's concurrent "
                    "streams are not verified with it); unset the variable to overlap"
                )
            native.moe_cache_set_overlap(self._ctx, overlap)
            try:
                if config.prefill_min_tokens:
                    cache.set_prefill(config.prefill_min_tokens, config.prefill_ahead)
                if config.precalc_from is not None:
                    cache.set_precalc(config.precalc_from, config.precalc_max_tokens)
                self.cache = (
                    make_prefetcher(cache, config, self.path, self.info)
                    if run is None
                    else CacheController(
                        cache,
                        run[0],
                        alloc=config.alloc,
                        native_step=run[1],
                        routed=spec_of(config.policy).loads_misses,
                    )
                )
                native.moe_cache_set_async(
                    self._ctx, config.loads_async(device) and not self.cache.issues_own_loads
                )
                if config.degrade is not None:
                    self.cache.degradation = GracefulDegradation(CacheResidency(cache), ratio=config.degrade)
                if isinstance(self.cache, NativePromoeController):
                    pol = self.cache.policy
                    assert isinstance(pol, PromoePolicy)
                    self.set_predictors(
                        [pol.predictor], n_out=pol.per_token, weights=self.cache.config.weights
                    )
            except BaseException:
                cache.close()
                self.cache = None  # no controller over a closed cache: the engine runs as without one
                self.set_policies(self._policies)
                raise
        self.set_policies(self._policies)
        if config is not None and config.precalc_from is not None and self._needs_callback():
            log.warning(
                "DAOP's pre-calculation runs only where the cache splits the ids in the graph: with the "
                "routing callback (a Python policy, --degrade, --blocking-loads) it does nothing"
            )
        return self.cache.cache if self.cache is not None else None
