"""Install what a PlacementPlan (edgemoe.plan.plan) decided on an open engine: first-use calibration on that
engine, the allocation across layers, the policy's config record, the assigner's costs; adaptive top-k."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..calibration import auto
from ..calibration.adaptive import GatingOptions, default_calibration_dir
from ..calibration.slot_alloc import allocate_slots, describe
from ..calibration.super_experts import protected_experts
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo
from ..plan.calibration import calibration_needs
from ..plan.planner import PlacementPlan
from ..plan.request import CacheRequest, PlacementError
from ..plan.tiers import TierStep
from ..policies.protected import ProtectedExperts
from ..policies.registry import completed
from ..runtime import native
from ..runtime.cache_config import CacheConfig, PolicyConfig, StaticConfig
from ..runtime.context_tiers import ContextTier, ContextTiers
from ..runtime.engine import Engine

log = logging.getLogger(__name__)

Notify = Callable[[str], None]  # where the notes for the user go (the CLI: stderr; the library: the log)


def calibration_for(
    model: Path,
    policies: tuple[str, ...],
    alloc: str | None,
    given: Path | None,
    *,
    n_threads: int = 0,
    also: tuple[tuple[str, tuple[str, ...]], ...] = (),
) -> Path | None:
    """The given calibration directory, else the model's; calibrated on first use when a policy (its spec's stages:
    static, daop: router frequencies; promoe: predictors), an option (`also`: (option, stages), e.g. dali's
    --dali-prefetch: predictors) or alloc dp (a routing trace) needs it."""
    given = given or default_calibration_dir(model)
    what, stages = calibration_needs(policies, alloc, also)
    if not stages:
        return given
    return auto.ensure_calibration(model, stages, what, given=given, n_threads=n_threads)


def enable_static_placement(engine: Engine, model: Path, slots: int, calibration: Path | None) -> None:
    """An expert cache of `slots` per MoE layer holding the calibration's most used decode experts (DAOP's initial
    placement, never swapped: the static policy), calibrated on first use; for measuring against a fixed residency."""
    cal = calibration_for(model, ("static",), None, calibration, n_threads=engine.n_threads)
    engine.enable_expert_cache(
        CacheConfig(min(slots, engine.info.n_expert), policy=StaticConfig(calibration=cal), alloc="equal")
    )


def assign_costs(header: GgufHeader, profile: str | None) -> dict[int, Any]:
    """The assigner's cost model per MoE layer (from the model's parsed header), from a profile (a bundled name
    or a file) or this machine's."""
    from ..perf.measure.profiling import default_profile_path
    from ..perf.model.costmodel import ModelShape, expert_costs
    from ..perf.model.profile import load_profile

    if profile is None:
        if not default_profile_path().exists():
            raise PlacementError(
                "`assign` needs a machine profile: measure this machine's with `edgemoe "
                "profile`, or give `profile='rtx4060-laptop'` (or another bundled one, or a file)"
            )
        profile = str(default_profile_path())
    return expert_costs(ModelShape.from_header(header), load_profile(profile))


def policy_config_for(
    req: CacheRequest, calibration: Path | None, costs: dict[int, Any] | None
) -> PolicyConfig:
    """The request's policy record with the calibration directory and the assigner's costs where it reads them."""
    return completed(req.config, calibration=calibration, assign_costs=costs)


def install_cache(
    engine: Engine, req: CacheRequest, placement: PlacementPlan, *, notify: Notify = log.info
) -> None:
    """Give an engine opened with `placement.load` the expert cache the request asks for (nothing where the plan
    has none: no request, a dense model, or a budget that holds the whole model), calibrating the model first on
    that engine where its calibration lacks a stage the policy reads."""
    if not placement.cache or placement.slots_per_layer is None:
        return
    need = placement.calibration
    calibration = need.directory
    if need.stages:  # made or completed on this engine (auto.ensure_calibration; nothing runs when complete)
        calibration = auto.ensure_calibration(
            engine.path,
            need.stages,
            need.what,
            given=need.directory,
            n_threads=engine.n_threads,
            engine=engine,
        )
    slots = placement.slots_per_layer
    allocation = allocate_slots(
        engine.info,
        alloc=req.alloc,
        policy=req.policy,
        calibration=calibration,
        slots_per_layer=slots,
        budget_bytes=placement.expert_budget_bytes,
        **req.config.allocation_options(),
    )
    if allocation.note:
        notify(f"note: {allocation.note}")
    dev = native.gpu_device()
    cfg = CacheConfig(
        slots if allocation.alloc == "equal" else allocation.slots,
        policy=policy_config_for(
            req, calibration, assign_costs(engine.header, req.profile) if req.assign else None
        ),
        alloc=allocation.alloc,
        degrade=req.degrade,
        protected=_protected(engine, calibration) if req.degrade is not None else ProtectedExperts(),
        prefill_min_tokens=req.device_prefill,
        prefill_ahead=req.device_prefill_ahead,
        prefill_borrow=req.device_prefill_borrow,
        precalc_from=req.precalc_from,
    )
    engine.enable_expert_cache(cfg, device=dev)
    if placement.context_steps:
        tiers = engine_tiers(
            engine.info,
            placement.context_steps,
            engine.n_ctx,
            cfg,
            alloc=req.alloc,
            policy=req.policy,
            calibration=calibration,
            **req.config.allocation_options(),
        )
        engine.set_context_tiers(tiers)
    notify(_describe(engine, req, describe(allocation), dev))


def _protected(engine: Engine, calibration: Path | None) -> ProtectedExperts:
    """The super experts degradation keeps: the calibration's (the model's own where none was needed)."""
    return protected_experts(calibration or default_calibration_dir(engine.path))


def _describe(engine: Engine, req: CacheRequest, allocation: str, dev: native.GgmlDevice | None) -> str:
    where = native.device_name(dev) if dev is not None else "CPU stand-in (no GPU in this build: no speedup)"
    cache = engine.experts
    prefetch = cache.report().get("prefetch") if cache is not None else None
    lines = []
    note = getattr(cache, "note", None)
    if note:
        lines.append(f"note: {note}")
    hook_reason = getattr(cache, "hook_reason", None)
    if hook_reason:
        lines.append(f"note: promoe runs in the routing hook (a Python call per MoE layer): {hook_reason}")
    lines.append(
        f"expert cache: {allocation} on {where}, policy {req.policy}"
        + (f" (predictor {prefetch['predictor']}, top-k+{prefetch['extra']})" if prefetch else "")
        + (" (blocking loads)" if req.blocking else "")
        + (f" (misses placed by the {req.assign} assigner)" if req.assign else "")
        + (f" (graceful degradation r={req.degrade})" if req.degrade is not None else "")
        + (
            f" (prefill ubatches of {req.device_prefill}+ tokens on the device, "
            f"{req.device_prefill_ahead} ahead{', buffers in borrowed slots' if req.device_prefill_borrow else ''})"
            if req.device_prefill
            else ""
        )
        + (f" (DAOP pre-calculation from layer {req.precalc_from})" if req.precalc_from is not None else "")
    )
    return "\n".join(lines)


def engine_tiers(
    info: ModelInfo,
    steps: tuple[TierStep, ...],
    n_ctx: int,
    cache: CacheConfig,
    **allocation: Any,
) -> ContextTiers:
    """A plan's context steps as the tiers of an engine of n_ctx tokens whose expert cache is `cache`
    (Engine.set_context_tiers): each step but the last with its slots allocated as the cache's were (equal, or
    `allocation`'s allocate_slots keywords, e.g. dp, over the step's bytes), then the engine's context with the
    cache's own slots."""

    def slots(step: TierStep) -> int | Mapping[int, int]:
        if cache.alloc == "equal":
            return step.slots_per_layer
        return allocate_slots(
            info, slots_per_layer=step.slots_per_layer, budget_bytes=step.expert_budget_bytes, **allocation
        ).slots

    return ContextTiers(
        (*(ContextTier(s.n_ctx, slots(s)) for s in steps[:-1]), ContextTier(n_ctx, cache.slots_per_layer))
    )


def gating_for(opts: GatingOptions, model: Path) -> GatingOptions:
    """`opts` with its calibration directory resolved: the one given, else the model's (default_calibration_dir).
    The one place that default is decided, for install_gating and `edgemoe perplexity`."""
    if opts.calibration is not None:
        return opts
    return replace(opts, calibration=default_calibration_dir(model))


def install_gating(engine: Engine, opts: GatingOptions | None, *, notify: Notify = log.info) -> None:
    """Adaptive top-k as `opts` asks, calibrated on first use; its calibration directory defaults to the
    model's (gating_for)."""
    from ..calibration.adaptive import build_gating, describe_calibrated

    if opts is None:
        return
    opts = gating_for(opts, engine.path)
    policy = build_gating(engine, opts)
    if policy is not None:
        path = engine.set_gating(policy)
        why = "it protects the calibration's super experts" if policy.protected else "blocking loads need it"
        where = "in the graph" if path == "graph" else f"in the routing hook ({why})"
        notify(
            f"gating: {opts.mode}, threshold {policy.threshold:.4g}, {where}"
            + (" (prefill at full top-k)" if opts.decode_only else "")
            + (f"; {describe_calibrated(policy.calibrated)}" if policy.calibrated else "")
        )
