"""CLI options of the expert cache (--vram, --expert-slots, --policy, --alloc, ...), and opening an engine
with them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .types import Size

POLICIES = ("lru", "dali", "daop", "static", "promoe", "manual")
POLICY_HELP = ("which experts the slots hold: lru (load misses for the next token), dali (DALI's "
               "workload-aware replacement: every --dali-window tokens the most-used absent experts "
               "replace the least-used resident ones; with --dali-prefetch also DALI's prefetcher, in the "
               "routing hook), daop (DAOP: the calibration's "
               "most used decode experts, swapped once per prompt by the prompt's routing), static (the calibration's most frequent), promoe (ProMoE's prefetcher: at each MoE layer "
               "the calibration's predictor names the experts of the layer --prefetch-distance ahead, which are "
               "copied before it runs; an LRU otherwise; inside llama.cpp, the predictor in the graph, stopping at each "
               "cached layer), manual (API only); lru, dali, daop, static and manual run inside llama.cpp's graph "
               "without stopping. static, daop, promoe and dali with "
               "--dali-prefetch calibrate a model without calibration data on first use. Default: static (projected "
               "fastest on a GPU), or the policy the other options belong to: dali with --dali-window, "
               "--dali-update or --dali-prefetch, promoe with --prefetch-distance or --prefetch-extra, lru with "
               "--assign or --blocking-loads")
# the default --policy: the policy the performance model projects fastest on a GPU on realistic routing (the bundled
# routing profiles of real models: 1.13-1.65x stock's decode, lru 0.35-1.55x; tools/default_policy.py,
# docs/expert-cache.md "Defaults")
DEFAULT_POLICY = "static"
ALLOC_HELP = ("slots per MoE layer: equal, or dp (AdapMoE's DP allocation: the same total, split to minimise "
              "the policy's misses replayed on the calibration's routing trace; --expert-slots N is then the "
              "average). Default: dp when the calibration has a routing trace, else equal")


@dataclass(frozen=True)
class CacheOptions:
    vram: int | None
    expert_slots: int | None
    policy: str
    blocking: bool
    alloc: str | None = None  # "equal", "dp", or None: dp when the calibration has a routing trace
    dali_window: int | None = None  # dali: tokens per window (None: the paper's, residency.DALI_WINDOW)
    dali_update: int | None = None  # dali: experts replaced per window (None: the paper's for this model)
    prefetch_distance: int | None = None  # promoe: predict layer l+d at layer l (None: ProMoE's 2)
    prefetch_extra: int | None = None  # promoe: prefetch the top-(k+m) (None: m = 1)
    dali_prefetch: int | None = None  # dali: next-layer experts prefetched per MoE layer (None, 0: none, native)
    assign: str | None = None  # lru, dali: the CPU/GPU assigner of each route's loads (None: none)
    profile: str | None = None  # --assign's machine profile (a bundled name or a file; None: this machine's)
    degrade: float | None = None  # DAOP's graceful degradation ratio (None: off)
    device_prefill: int = 0  # prefill ubatches of this many tokens or more run on the cache's device (0: off)
    device_prefill_ahead: str = "all"  # what they copy one cached layer ahead
    precalc_from: int | None = None  # DAOP's pre-calculation of the cached layers from this one on (None: off)

    @property
    def enabled(self) -> bool:
        return self.vram is not None or self.expert_slots is not None


def cache_options(f: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--vram", type=Size(auto=True), default=None,
                     help="GPU budget, e.g. 6GiB (auto: the GPU's free memory now): dense weights and KV cache "
                          "first, the rest as expert slots (split over the MoE layers as --alloc says); a budget "
                          "that holds the whole model runs it on the GPU as stock llama.cpp does, without an expert "
                          "cache"),
        click.option("--expert-slots", type=click.IntRange(min=0), default=None,
                     help="expert slots per MoE layer (instead of --vram; with --alloc dp the average)"),
        click.option("--policy", type=click.Choice(POLICIES), default=None, help=POLICY_HELP),
        click.option("--alloc", type=click.Choice(["equal", "dp"]), default=None, help=ALLOC_HELP),
        click.option("--dali-window", type=click.IntRange(min=1), default=None,
                     help="dali: tokens per window (the paper's w; default 4)"),
        click.option("--dali-update", type=click.IntRange(min=1), default=None,
                     help="dali: most experts replaced per window (the paper's u; default: experts per "
                          "layer / 8, rounded up)"),
        click.option("--dali-prefetch", type=click.IntRange(min=0), default=None,
                     help="dali: also prefetch, at each MoE layer, the N experts of the next one that DALI's "
                          "residual predictor expects most tokens to use (the paper's prefetch size: 1 for 8 "
                          "experts, 4 for more; calibrates on first use; runs in the routing hook: a host sync "
                          "per MoE layer). Default 0: replacement only, inside llama.cpp"),
        click.option("--prefetch-distance", type=click.IntRange(min=1), default=None,
                     help="promoe: predict the experts of the MoE layer this many layers ahead (default 2, "
                          "ProMoE's stride; 1: the next layer)"),
        click.option("--prefetch-extra", type=click.IntRange(min=0), default=None,
                     help="promoe: prefetch the top k + M predicted experts (default 1)"),
        click.option("--assign", type=click.Choice(["ratio", "greedy"]), default=None,
                     help="lru, dali: at every MoE layer and step, load the misses a CPU/GPU assigner puts on "
                          "the GPU before the layer runs (the others run on the CPU and load for the next "
                          "step), minimising max(CPU time, GPU time + copies) by --profile's costs: ratio (the "
                          "best cut, within 5% of the optimum) or greedy (DALI's). Runs in the routing hook: a "
                          "host sync per MoE layer"),
        click.option("--profile", default=None,
                     help="--assign's machine profile: a bundled name (rtx4060-laptop, rtx4090-desktop, "
                          "h100-server, and the backtest's machines: docs/performance-model.md) or a file; "
                          "default: this machine's (`edgemoe profile`)"),
        click.option("--degrade", type=click.FloatRange(0.0, 1.0, min_open=True), default=None, metavar="R",
                     help="DAOP's graceful degradation: in decode, a token's expert that is not resident (not its "
                          "best) is replaced by the best resident one it did not select whose router score is at "
                          "least R times its own (e.g. 0.8). Fewer CPU experts for a small quality cost "
                          "(docs/daop.md); changes the output; runs in the routing hook"),
        click.option("--device-prefill", type=click.IntRange(min=0), default=0, metavar="N",
                     help="prefill ubatches of N or more tokens (e.g. 32) also run each cached layer's other "
                          "experts on the GPU, from two buffers of a whole layer's experts (taken from --vram) "
                          "that the next cached layer's experts copy into while this one computes. Stops at "
                          "each cached layer of a prefill ubatch. Default 0: off (they run on the CPU, or "
                          "llama.cpp's op offload copies them)"),
        click.option("--device-prefill-ahead", type=click.Choice(["all", "predicted", "routed"]), default="all",
                     help="with --device-prefill, what copies one cached layer ahead: all (the next layer's "
                          "experts outside its slots), predicted (those promoe's in-graph predictor names), routed "
                          "(nothing: each layer copies what it routes, the GPU waiting)"),
        click.option("--precalc-from", type=click.IntRange(min=1), default=None, metavar="L",
                     help="DAOP's pre-calculation: in decode, each cached MoE layer from layer L on has its experts "
                          "predicted at the layer before by its own router on that layer's input; the predicted "
                          "ones outside its slots run on the CPU on that input while the GPU computes the layer's "
                          "attention, and it takes their results (approximate: changes the output; the paper "
                          "starts at a quarter of the depth; docs/daop.md). Projected slower than without "
                          "it: 0.92-1.01x daop's decode from the last 3/8 of the layers, 0.77-0.98x from "
                          "layer 1, on the bundled GPU profiles at 8 GiB (docs/performance-model.md). Needs "
                          "the cache's tables: not with --degrade, --assign, --blocking-loads or "
                          "--dali-prefetch. Default: off"),
        click.option("--blocking-loads", is_flag=True,
                     help="lru, dali, promoe: load a missed expert before its layer runs instead of running "
                          "it on the CPU (needs the routing callback: a host sync per MoE layer)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def default_policy(*, blocking: bool = False, assign: str | None = None, dali_window: int | None = None,
                   dali_update: int | None = None, dali_prefetch: int | None = None,
                   prefetch_distance: int | None = None, prefetch_extra: int | None = None) -> str:
    """The policy when --policy is not given: the one the other options belong to, else DEFAULT_POLICY."""
    if dali_window is not None or dali_update is not None or dali_prefetch:
        return "dali"
    if prefetch_distance is not None or prefetch_extra is not None:
        return "promoe"
    if assign is not None or blocking:
        return "lru"  # static never loads a miss: nothing to block on or to assign
    return DEFAULT_POLICY


def cache_from_options(vram: int | None, expert_slots: int | None, policy: str | None, blocking: bool,
                       alloc: str | None = None, dali_window: int | None = None,
                       dali_update: int | None = None, prefetch_distance: int | None = None,
                       prefetch_extra: int | None = None, dali_prefetch: int | None = None,
                       assign: str | None = None, profile: str | None = None,
                       degrade: float | None = None, device_prefill: int = 0,
                       device_prefill_ahead: str = "all", precalc_from: int | None = None) -> CacheOptions:
    if vram is not None and expert_slots is not None:
        raise click.UsageError("give --vram or --expert-slots, not both")
    if policy is None:
        policy = default_policy(blocking=blocking, assign=assign, dali_window=dali_window, dali_update=dali_update,
                                dali_prefetch=dali_prefetch, prefetch_distance=prefetch_distance,
                                prefetch_extra=prefetch_extra)
    if policy != "promoe" and (prefetch_distance is not None or prefetch_extra is not None):
        raise click.UsageError("--prefetch-distance and --prefetch-extra are options of --policy promoe")
    if dali_prefetch and (policy != "dali" or blocking):
        raise click.UsageError("--dali-prefetch is an option of --policy dali without --blocking-loads "
                               "(a missed expert runs on the CPU while the prefetcher loads the next layer's)")
    if assign is not None and (policy not in ("lru", "dali") or blocking or dali_prefetch):
        raise click.UsageError("--assign is an option of --policy lru or dali without --blocking-loads or "
                               "--dali-prefetch (it decides which of their misses to load before the layer runs)")
    if profile is not None and assign is None:
        raise click.UsageError("--profile gives --assign its costs: add --assign ratio (or greedy)")
    if (assign is not None or degrade is not None) and vram is None and expert_slots is None:
        raise click.UsageError("--assign and --degrade act on the expert cache: give --vram or --expert-slots")
    if device_prefill and vram is None and expert_slots is None:
        raise click.UsageError("--device-prefill runs prefill from the expert cache's device: give --vram or "
                               "--expert-slots")
    if device_prefill_ahead != "all" and not device_prefill:
        raise click.UsageError("--device-prefill-ahead says what --device-prefill copies ahead: add --device-prefill N")
    if precalc_from is not None:
        if vram is None and expert_slots is None:
            raise click.UsageError("--precalc-from pre-calculates the experts outside the expert cache's slots: give "
                                   "--vram or --expert-slots")
        hook = [o for o, on in (("--degrade", degrade is not None), ("--assign", assign is not None),
                                ("--blocking-loads", blocking), ("--dali-prefetch", bool(dali_prefetch))) if on]
        if hook:
            raise click.UsageError(f"--precalc-from needs the cache's tables in the graph; {hook[0]} runs the cache "
                                   "from the routing hook: leave one of the two out")
    return CacheOptions(vram, expert_slots, policy, blocking, alloc, dali_window, dali_update,
                        prefetch_distance, prefetch_extra, dali_prefetch, assign, profile, degrade,
                        device_prefill, device_prefill_ahead, precalc_from)


def check_precalc_from(info: Any, first_layer: int) -> None:
    """--precalc-from must leave a MoE layer that follows a MoE layer (else it would do nothing)."""
    from ..policies.daop import precalc_targets

    moe = list(info.moe_layers)
    if not precalc_targets(moe, first_layer):
        raise click.UsageError(f"--precalc-from {first_layer}: no MoE layer from there on follows a MoE layer "
                               f"(this model's MoE layers: {moe[0]}..{moe[-1]}); give a smaller layer")


def slots_for(info: Any, opts: CacheOptions, n_ctx: int) -> int:
    """Expert slots per MoE layer: --expert-slots, or what --vram leaves after dense weights and KV cache."""
    if opts.expert_slots is not None:
        return opts.expert_slots
    from ..gguf.info import vram_plan, vram_reserve

    return vram_plan(info, opts.vram or 0, n_ctx=n_ctx,
                     reserve_bytes=vram_reserve(info, bool(opts.device_prefill))).experts_per_layer


def whole_model_fits(info: Any, opts: CacheOptions, n_ctx: int) -> bool:
    """--vram holds the whole model: its dense part, the KV cache of n_ctx tokens (0: the engine's default) and
    every expert of every MoE layer. It then runs on the GPU as stock llama.cpp's -ngl 999 does, without an expert
    cache, whose slots would hold every expert and only add graph nodes (docs/performance-model.md: 0.85-1.0x)."""
    from ..gguf.info import VRAM_RESERVE, vram_plan
    from ..runtime.config import planned_ctx

    if opts.vram is None or not info.is_moe:
        return False
    return vram_plan(info, opts.vram, n_ctx=planned_ctx(n_ctx, info.n_ctx_train),
                     reserve_bytes=VRAM_RESERVE).all_experts_fit


def load_config(base: Any, opts: CacheOptions, model: Path) -> Any:
    """The engine's LoadConfig with the cache's needs: on a GPU build, experts in CPU memory and the rest on the GPU;
    every layer on the GPU where --vram holds the whole model."""
    from dataclasses import replace

    from ..runtime import native
    from ..gguf.info import read_model_info

    if not opts.enabled or native.gpu_device() is None:
        return base
    info = read_model_info(model)
    if whole_model_fits(info, opts, base.n_ctx):
        return replace(base, n_gpu_layers=999)
    return replace(base, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))


def calibration_for(model: Path, policies: tuple[str, ...], alloc: str | None, given: Path | None, *,
                    n_threads: int = 0, dali_prefetch: int | None = None) -> Path | None:
    """--calibration, else the model's; calibrated on first use when a policy (static, daop: router frequencies;
    promoe, dali with --dali-prefetch: predictors) or --alloc dp (a routing trace) needs it."""
    from ..calibration.adaptive import default_calibration_dir
    from ..calibration.auto import STAGES_FOR, ensure_calibration

    given = given or default_calibration_dir(model)
    needs = [(f"--policy {p}", STAGES_FOR["static"]) for p in ("static", "daop") if p in policies]
    needs += [("--policy promoe", STAGES_FOR["predictors"])] if "promoe" in policies else []
    needs += [("--dali-prefetch", STAGES_FOR["predictors"])] if dali_prefetch else []
    needs += [("--alloc dp", STAGES_FOR["dp"])] if alloc == "dp" else []
    if not needs:
        return given
    stages = tuple(dict.fromkeys(s for _, ss in needs for s in ss))
    return ensure_calibration(model, stages, " and ".join(w for w, _ in needs), given=given, n_threads=n_threads)


def enable_daop_placement(engine: Any, model: Path, slots: int, calibration: Path | None) -> None:
    """An expert cache of `slots` per MoE layer holding the calibration's most used decode experts (DAOP's initial
    placement, never swapped: the static policy), calibrated on first use; for measuring against a fixed residency."""
    from ..runtime.expert_cache import CacheConfig

    cal = calibration_for(model, ("static",), None, calibration, n_threads=engine.n_threads)
    engine.enable_expert_cache(CacheConfig(min(slots, engine.info.n_expert), policy="static", calibration=cal,
                                           alloc="equal"))


def assign_costs(model: Path, profile: str | None) -> dict[int, Any]:
    """--assign's cost model per MoE layer, from --profile or this machine's measured profile."""
    from ..perf.costmodel import ModelShape, expert_costs
    from ..perf.profile import load_profile
    from ..perf.profiling import default_profile_path

    if profile is None:
        if not default_profile_path().exists():
            raise click.UsageError("--assign needs a machine profile: measure this machine's with `edgemoe "
                                   "profile`, or give --profile rtx4060-laptop (or another bundled one, or a file)")
        profile = str(default_profile_path())
    return expert_costs(ModelShape.read(model), load_profile(profile))


def install_cache(engine: Any, model: Path, opts: CacheOptions, calibration: Path | None) -> None:
    from ..runtime import native
    from ..calibration.allocation import describe, plan_allocation
    from ..gguf.info import vram_plan, vram_reserve
    from ..policies.prefetch import PROMOE_DISTANCE, PROMOE_EXTRA
    from ..policies.residency import DALI_WINDOW
    from ..runtime.expert_cache import CacheConfig

    if not opts.enabled or not engine.info.is_moe:
        return
    if whole_model_fits(engine.info, opts, engine.config.n_ctx):
        from ..gguf.info import format_size

        where = "on the GPU" if native.gpu_device() is not None else "as stock llama.cpp does (no GPU in this build)"
        click.echo(f"note: --vram {format_size(opts.vram or 0)} holds the whole model (every expert of every MoE "
                   f"layer): it runs {where}, without an expert cache (--policy and the cache's options have "
                   "nothing to do); give --expert-slots N for a cache all the same", err=True)
        return
    if opts.precalc_from is not None:
        check_precalc_from(engine.info, opts.precalc_from)
    slots = slots_for(engine.info, opts, engine.n_ctx)
    CacheConfig(slots).slots(list(engine.info.moe_layers), engine.info.n_expert)  # --expert-slots in range
    calibration = calibration_for(model, (opts.policy,), opts.alloc, calibration, n_threads=engine.n_threads,
                                  dali_prefetch=opts.dali_prefetch)
    budget = None
    if opts.vram is not None:  # dp splits the same bytes; each layer's slot costs its own bytes per expert
        plan_bytes = vram_plan(engine.info, opts.vram, n_ctx=engine.n_ctx, reserve_bytes=vram_reserve(engine.info, bool(opts.device_prefill)))
        budget = plan_bytes.expert_budget_bytes
    window = opts.dali_window or DALI_WINDOW
    plan = plan_allocation(engine.info, alloc=opts.alloc, policy=opts.policy, calibration=calibration,
                           slots_per_layer=slots, budget_bytes=budget, dali_window=window,
                           dali_update=opts.dali_update)
    if plan.note:
        click.echo(f"note: {plan.note}", err=True)
    dev = native.gpu_device()
    cfg = CacheConfig(slots if plan.alloc == "equal" else plan.slots, policy=opts.policy,
                      blocking=opts.blocking, calibration=calibration, dali_window=window,
                      dali_update=opts.dali_update, alloc=plan.alloc,
                      prefetch_distance=opts.prefetch_distance or PROMOE_DISTANCE,
                      prefetch_extra=PROMOE_EXTRA if opts.prefetch_extra is None else opts.prefetch_extra,
                      dali_prefetch=opts.dali_prefetch or 0, assign=opts.assign,
                      assign_costs=assign_costs(model, opts.profile) if opts.assign else None,
                      degrade=opts.degrade, prefill_min_tokens=opts.device_prefill,
                      prefill_ahead=opts.device_prefill_ahead, precalc_from=opts.precalc_from)
    engine.enable_expert_cache(cfg, device=dev)
    where = native.device_name(dev) if dev is not None else "CPU stand-in (no GPU in this build: no speedup)"
    prefetch = engine.cache.report().get("prefetch") if engine.cache is not None else None
    note = getattr(engine.cache, "note", None)
    if note:
        click.echo(f"note: {note}", err=True)
    hook_reason = getattr(engine.cache, "hook_reason", None)
    if hook_reason:
        click.echo(f"note: promoe runs in the routing hook (a Python call per MoE layer): {hook_reason}", err=True)
    click.echo(f"expert cache: {describe(plan)} on {where}, policy {opts.policy}"
               + (f" (predictor {prefetch['predictor']}, top-k+{prefetch['extra']})" if prefetch else "")
               + (" (blocking loads)" if opts.blocking else "")
               + (f" (misses placed by the {opts.assign} assigner)" if opts.assign else "")
               + (f" (graceful degradation r={opts.degrade})" if opts.degrade is not None else "")
               + (f" (prefill ubatches of {opts.device_prefill}+ tokens on the device, "
                  f"{opts.device_prefill_ahead} ahead)" if opts.device_prefill else "")
               + (f" (DAOP pre-calculation from layer {opts.precalc_from})" if opts.precalc_from is not None else ""),
               err=True)
