"""The MoE routing hook, adaptive top-k and the expert cache of an Engine: who decides each routing.

Routing is a part of Engine (edgemoe.runtime.engine): it owns the hook chain, the user's policies and the
expert cache's controller (engine.experts), and is given the gating (engine.gating) and the predictors in the
graph (engine.prefetch) it wires with them. Adaptive top-k and the expert cache's
residency (expert-to-slot tables, the lru, dali and daop policies) run inside llama.cpp's graph, with no host
round trip per MoE layer, while nothing needs the routing callback. A Python policy (or lru or dali with
blocking loads, promoe, dali's prefetcher) needs it: then gating runs first in the hook chain, then the
user's policies, then the expert-cache controller when its residency policy needs the routes; one
HookChain serves all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import EdgeMoeError
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo
from ..policies.assignment import make_assigner
from ..policies.degrade import GracefulDegradation
from ..policies.miss_assignment import AssignedPolicy
from ..policies.registry import NativeStep, PolicyInputs, spec_of
from ..policies.residency import ResidencyPolicy
from ..policies.route import RoutePolicy
from . import native
from .cache_config import CacheConfig, PolicyConfig
from .expert_cache import CacheController, CacheResidency, ExpertCache
from .gating import Gating
from .handle import NativeHandle
from .hooks import HookChain
from .prediction import GraphPredictors
from .prefetcher import make_prefetcher

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
            "`assign` needs a cost model: a machine profile with a GPU (`profile`: a bundled name or a file; "
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


class Routing:
    """Who decides each routing of one context: the hook chain over gating (when it runs in the hook), the
    user's policies and the expert cache's controller (engine.experts), which this object owns."""

    def __init__(
        self,
        handle: NativeHandle,
        header: GgufHeader,
        info: ModelInfo,
        gating: Gating,
        prefetch: GraphPredictors,
    ) -> None:
        self.handle = handle
        self.header = header  # the model's GGUF header: the expert cache reads its tensors' offsets
        self.info = info
        self.gating = gating
        self.prefetch = prefetch  # native promoe's predictor goes into the graph with the cache
        self.hooks: HookChain | None = None  # the routing callback's chain (None: no callback)
        self.policies: list[RoutePolicy] = []  # the user's, before the cache controller
        self.experts: CacheController | None = None  # the expert cache (Engine.enable_expert_cache)
        # what the cache was made from (None: no cache): a re-created context gets it again (context_tiers)
        self.cache_config: CacheConfig | None = None
        self.cache_device: object = None

    def set_policies(self, policies: Sequence[RoutePolicy] | None) -> HookChain | None:
        """Route every MoE layer of every ubatch through these policies (None or [] removes the hook)."""
        self.policies = list(policies or [])
        callback = self.needs_callback()
        experts, gating = self.experts, self.gating.policy
        if experts is not None:
            experts.set_mode(native.MOE_CACHE_POLICY_CALLBACK if callback else experts.native_policy)
        hook_gating = gating is not None and callback
        degrade = experts.degradation if experts is not None else None
        chain = (
            ([gating] if hook_gating and gating is not None else [])
            + self.policies
            + ([degrade] if degrade else [])
            + ([experts] if callback and experts is not None and experts.needs_routes else [])
        )
        self.gating.set_in_graph(None if hook_gating else gating)
        ctx = self.handle.ctx
        if chain:
            hooks = HookChain(chain)
            native.moe_set_hook(ctx, hooks.c_callback, hooks.flags)
            self.hooks = hooks  # the old chain's C callback is freed only once llama.cpp holds the new one
        else:
            native.moe_set_hook(ctx, None, 0)
            self.hooks = None
        return self.hooks

    @contextmanager
    def decode_rules_for_batches(self) -> Iterator[None]:
        """While speculation verifies several positions per ubatch: the decode-only rules (adaptive top-k, the
        expert cache's degradation) apply to every ubatch, as each position is a decode step."""
        experts = self.experts
        rules = [r for r in (self.gating.policy, experts.degradation if experts else None) if r is not None]
        flagged = [r for r in rules if r.decode_only]
        if not flagged:
            yield
            return
        for r in flagged:
            r.decode_only = False
        self.rewire()
        try:
            yield
        finally:
            for r in flagged:
                r.decode_only = True
            self.rewire()

    def rewire(self) -> HookChain | None:
        """set_policies with the user's policies as they are (after the gating or the cache changed)."""
        return self.set_policies(self.policies)

    def needs_callback(self) -> bool:
        """Does anything need the routing callback: a Python policy, gating that protects experts, or an
        expert-cache policy that runs in it (blocking loads, dali)?"""
        # native promoe maps the cached layers' ids in the callback, where gating must run too (the graph's
        # gating leaves layers the callback maps alone)
        experts, gating = self.experts, self.gating.policy
        # the graph's gate (ggml_moe_gate) knows no protected experts: a policy with some runs in the hook
        protects = gating is not None and bool(gating.protected)
        return (
            bool(self.policies)
            or protects
            or (
                experts is not None
                and (
                    experts.native_policy == native.MOE_CACHE_POLICY_CALLBACK
                    or experts.degradation is not None
                    or (
                        self.gating.policy is not None
                        and experts.native_policy == native.MOE_CACHE_POLICY_PREDICTED_PREFETCH
                    )
                )
            )
        )

    @property
    def gating_path(self) -> str | None:
        """Where adaptive top-k runs: "graph" (inside llama.cpp), "hook" (the Python callback) or None."""
        if self.gating.policy is None:
            return None
        return "hook" if self.needs_callback() else "graph"

    def take_error(self) -> BaseException | None:
        """The exception a policy raised inside the hook during the last decode (None: none)."""
        return self.hooks.take_error() if self.hooks else None

    def flush_loads(self) -> None:
        """After each decode: the expert cache's loads decided at an earlier layer."""
        if self.experts is not None:
            self.experts.flush()

    def close_experts(self) -> None:
        """Free the expert cache (before its context); the hook chain is left as it is."""
        if self.experts is not None:
            self.experts.close()
            self.experts = None

    def enable_expert_cache(self, config: CacheConfig | None, device: object = None) -> ExpertCache | None:
        """Engine.enable_expert_cache: the cache config describes (None: none) in place of the one before."""
        if self.experts is not None:
            if self.experts.graph_predictors() is not None:  # its predictor leaves the graph with it
                self.prefetch.set(None)
            self.close_experts()
        self.cache_config, self.cache_device = None, None
        if config is not None:
            self._open_experts(config, device)
            self.cache_config, self.cache_device = config, device
        self.rewire()
        if config is not None and config.precalc_from is not None and self.needs_callback():
            log.warning(
                "DAOP's pre-calculation runs only where the cache splits the ids in the graph: with the "
                "routing callback (a Python policy, `degrade`, `blocking`) it does nothing"
            )
        return self.experts.cache if self.experts is not None else None

    def _open_experts(self, config: CacheConfig, device: object) -> None:
        """The cache and its controller in self.experts; on failure none, the hook rewired without one."""
        info, ctx = self.info, self.handle.ctx
        slots = config.slots(list(info.moe_layers), info.n_expert)
        run = None if config.prefetcher else residency_run(config.policy, slots, info.n_expert)
        cache = ExpertCache(
            ctx, self.header, list(info.moe_layers), info.n_layer, info.n_expert, slots, device
        )
        overlap = config.overlap_on(os.environ)
        if config.overlap and not overlap:
            log.warning(
                "GGML_CUDA_GRAPH_OPT=1: the expert cache's CPU/GPU overlap is off (llama.cpp's concurrent "
                "streams are not verified with it); unset the variable to overlap"
            )
        native.moe_cache_set_overlap(ctx, overlap)
        try:
            self._control(cache, config, run, device)
        except BaseException:
            cache.close()
            self.experts = None  # no controller over a closed cache: the engine runs as without one
            self.rewire()
            raise

    def _control(
        self,
        cache: ExpertCache,
        config: CacheConfig,
        run: tuple[ResidencyPolicy | AssignedPolicy, NativeStep | None] | None,
        device: object,
    ) -> None:
        """Set up cache's prefill and pre-calculation and put its controller in self.experts."""
        if config.prefill_min_tokens:
            cache.set_prefill(config.prefill_min_tokens, config.prefill_ahead, borrow=config.prefill_borrow)
        if config.precalc_from is not None:
            cache.set_precalc(config.precalc_from, config.precalc_max_tokens)
        self.experts = experts = (
            make_prefetcher(cache, config, self.header.path, self.info)
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
            self.handle.ctx, config.loads_async(device) and not experts.issues_own_loads
        )
        if config.degrade is not None:
            experts.degradation = GracefulDegradation(
                CacheResidency(cache), ratio=config.degrade, protected=config.protected
            )
        graph = experts.graph_predictors()  # a prefetcher run inside llama.cpp: its predictor in the graph
        if graph is not None:
            predictors, per_token, weights = graph
            self.prefetch.set(predictors, n_out=per_token, weights=weights)
