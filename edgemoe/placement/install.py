"""Turn a CacheRequest into the engine's load config and its expert cache: slots from the budget, the whole-model
case, first-use calibration, the allocation across layers, the assigner's costs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..calibration import auto
from ..calibration.adaptive import GatingOptions, default_calibration_dir
from ..calibration.slot_plan import describe, plan_allocation
from ..gguf.header import GgufHeader
from ..gguf.info import VRAM_RESERVE, ModelInfo, format_size, vram_plan, vram_reserve
from ..policies.daop import precalc_targets
from ..policies.registry import completed, policy_spec
from ..runtime import native
from ..runtime.cache_config import CacheConfig, PolicyConfig, StaticConfig, checked_slots
from ..runtime.config import planned_ctx
from ..runtime.engine import Engine, LoadConfig
from .request import CacheRequest, PlacementError

log = logging.getLogger(__name__)

Notify = Callable[[str], None]  # where the notes for the user go (the CLI: stderr; the library: the log)


def check_precalc_from(info: ModelInfo, first_layer: int) -> None:
    """precalc_from must leave a MoE layer that follows a MoE layer (else it would do nothing)."""
    moe = list(info.moe_layers)
    if not precalc_targets(moe, first_layer):
        raise PlacementError(
            f"--precalc-from {first_layer}: no MoE layer from there on follows a MoE layer "
            f"(this model's MoE layers: {moe[0]}..{moe[-1]}); give a smaller layer"
        )


def slots_for(info: ModelInfo, req: CacheRequest, n_ctx: int) -> int:
    """Expert slots per MoE layer: the request's, or what its budget leaves after dense weights and KV cache."""
    if req.expert_slots is not None:
        return req.expert_slots
    return vram_plan(
        info, req.vram or 0, n_ctx=n_ctx, reserve_bytes=vram_reserve(info, bool(req.device_prefill))
    ).experts_per_layer


def whole_model_fits(info: ModelInfo, req: CacheRequest, n_ctx: int) -> bool:
    """The budget holds the whole model: its dense part, the KV cache of n_ctx tokens (0: the engine's default) and
    every expert of every MoE layer. It then runs on the GPU as stock llama.cpp's -ngl 999 does, without an expert
    cache, whose slots would hold every expert and only add graph nodes (docs/research/performance-model.md: 0.85-1.0x)."""
    if req.vram is None or not info.is_moe:
        return False
    return vram_plan(
        info, req.vram, n_ctx=planned_ctx(n_ctx, info.n_ctx_train), reserve_bytes=VRAM_RESERVE
    ).all_experts_fit


def load_config(base: LoadConfig, req: CacheRequest | None, info: ModelInfo) -> LoadConfig:
    """The engine's LoadConfig with the cache's needs: on a GPU build, experts in CPU memory and the rest on the
    GPU; every layer on the GPU where the budget holds the whole model. `info`: the model's (model_info of the
    header the engine is given)."""
    if req is None or not req.enabled or native.gpu_device() is None:
        return base
    if whole_model_fits(info, req, base.n_ctx):
        return replace(base, n_gpu_layers=999)
    return replace(base, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))


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
    needs = [(f"--policy {p}", policy_spec(p).stages) for p in policies if policy_spec(p).stages]
    needs += list(also)
    needs += [("--alloc dp", auto.STAGES_FOR["dp"])] if alloc == "dp" else []
    if not needs:
        return given
    stages = tuple(dict.fromkeys(s for _, ss in needs for s in ss))
    return auto.ensure_calibration(
        model, stages, " and ".join(w for w, _ in needs), given=given, n_threads=n_threads
    )


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
    from ..perf.costmodel import ModelShape, expert_costs
    from ..perf.profile import load_profile
    from ..perf.profiling import default_profile_path

    if profile is None:
        if not default_profile_path().exists():
            raise PlacementError(
                "--assign needs a machine profile: measure this machine's with `edgemoe "
                "profile`, or give --profile rtx4060-laptop (or another bundled one, or a file)"
            )
        profile = str(default_profile_path())
    return expert_costs(ModelShape.from_header(header), load_profile(profile))


def policy_config_for(
    req: CacheRequest, calibration: Path | None, costs: dict[int, Any] | None
) -> PolicyConfig:
    """The request's policy record with the calibration directory and the assigner's costs where it reads them."""
    return completed(req.config, calibration=calibration, assign_costs=costs)


def install_cache(
    engine: Engine, model: Path, req: CacheRequest, calibration: Path | None, *, notify: Notify = log.info
) -> None:
    """Give an open engine the expert cache the request asks for (nothing where the budget holds the model)."""
    if not req.enabled or not engine.info.is_moe:
        return
    if whole_model_fits(engine.info, req, engine.config.n_ctx):
        where = (
            "on the GPU"
            if native.gpu_device() is not None
            else "as stock llama.cpp does (no GPU in this build)"
        )
        notify(
            f"note: --vram {format_size(req.vram or 0)} holds the whole model (every expert of every MoE "
            f"layer): it runs {where}, without an expert cache (--policy and the cache's options have "
            "nothing to do); give --expert-slots N for a cache all the same"
        )
        return
    if req.precalc_from is not None:
        check_precalc_from(engine.info, req.precalc_from)
    slots = slots_for(engine.info, req, engine.n_ctx)
    checked_slots(slots, list(engine.info.moe_layers), engine.info.n_expert)  # slots in range
    calibration = calibration_for(
        model,
        (req.policy,),
        req.alloc,
        calibration,
        n_threads=engine.n_threads,
        also=tuple(x for x in (req.config.extra_calibration(),) if x is not None),
    )
    budget = None
    if req.vram is not None:  # dp splits the same bytes; each layer's slot costs its own bytes per expert
        budget = vram_plan(
            engine.info,
            req.vram,
            n_ctx=engine.n_ctx,
            reserve_bytes=vram_reserve(engine.info, bool(req.device_prefill)),
        ).expert_budget_bytes
    plan = plan_allocation(
        engine.info,
        alloc=req.alloc,
        policy=req.policy,
        calibration=calibration,
        slots_per_layer=slots,
        budget_bytes=budget,
        **req.config.allocation_options(),
    )
    if plan.note:
        notify(f"note: {plan.note}")
    dev = native.gpu_device()
    cfg = CacheConfig(
        slots if plan.alloc == "equal" else plan.slots,
        policy=policy_config_for(
            req, calibration, assign_costs(engine.header, req.profile) if req.assign else None
        ),
        alloc=plan.alloc,
        degrade=req.degrade,
        prefill_min_tokens=req.device_prefill,
        prefill_ahead=req.device_prefill_ahead,
        precalc_from=req.precalc_from,
    )
    engine.enable_expert_cache(cfg, device=dev)
    notify(_describe(engine, req, describe(plan), dev))


def _describe(engine: Engine, req: CacheRequest, allocation: str, dev: native.GgmlDevice | None) -> str:
    where = native.device_name(dev) if dev is not None else "CPU stand-in (no GPU in this build: no speedup)"
    cache = engine.cache
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
            f"{req.device_prefill_ahead} ahead)"
            if req.device_prefill
            else ""
        )
        + (f" (DAOP pre-calculation from layer {req.precalc_from})" if req.precalc_from is not None else "")
    )
    return "\n".join(lines)


def gating_for(opts: GatingOptions, model: Path) -> GatingOptions:
    """`opts` with its calibration directory resolved: the one given, else the model's (default_calibration_dir).
    The one place that default is decided, for install_gating and `edgemoe perplexity`."""
    if opts.calibration is not None:
        return opts
    return replace(opts, calibration=default_calibration_dir(model))


def install_gating(engine: Engine, opts: GatingOptions | None, *, notify: Notify = log.info) -> None:
    """Adaptive top-k as `opts` asks, calibrated on first use; its calibration directory defaults to the
    model's (gating_for)."""
    from ..calibration.adaptive import build_gating

    if opts is None:
        return
    opts = gating_for(opts, engine.path)
    policy = build_gating(engine, opts)
    if policy is not None:
        path = engine.set_gating(policy)
        where = "in the graph" if path == "graph" else "in the routing hook (blocking loads need it)"
        notify(
            f"gating: {opts.mode}, threshold {policy.threshold:.4g}, {where}"
            + (" (prefill at full top-k)" if opts.decode_only else "")
        )
