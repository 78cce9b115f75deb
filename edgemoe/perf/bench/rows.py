"""The rows of `edgemoe bench`, each a plan() call: stock llama.cpp's placements (every routed expert in CPU memory,
`-ot exps=CPU`, and on a GPU the best `--n-cpu-moe N` the budget holds) and each edgemoe policy with the slots the
same budget leaves, as `generate --vram` plans them, with the variants the spec asks for.

The ubatches: a `-ub` given runs every row; else on a GPU with a GPU machine profile the stock rows run stock's
fastest -ub for the bench's prompt (the prefill plan, edgemoe.perf.model.prefill_plan) with the --n-cpu-moe beside
that compute buffer, and the +device prefill rows the ubatch plan() picks; everything else runs 512.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...calibration.slot_alloc import allocate_slots
from ...errors import EdgeMoeError
from ...gguf.header import GgufHeader
from ...gguf.info import ModelInfo, model_info
from ...gguf.kv_types import KvCacheType, KvTypes
from ...placement.install import engine_tiers
from ...plan.planner import Device, PlacementPlan, budget_request, plan
from ...plan.request import CacheRequest, cache_request
from ...plan.reserve import PLAN_UBATCH, mtp_reserve_bytes
from ...plan.ubatch import PrefillQuestion
from ...policies.registry import calibrated_config, compared_policies, policy_spec
from ...runtime.cache_config import CacheConfig
from ...runtime.config import FlashAttn
from ...speculation.config import SpeculationConfig
from ..model.prefill_plan import ProfilePricing
from .records import BenchRow, Projection


@dataclass(frozen=True)
class BenchSpec:
    vram: int  # budget in bytes
    prompt_tokens: int = 512
    gen_tokens: int = 64
    threads: int = 0
    n_ctx: int = 0  # 0: prompt + gen rounded up
    # also run each policy's first row with the context created in steps ("... +tiers"; where n_ctx has a step)
    context_tiers: bool = False
    # the edgemoe policies to run (default: the registry's comparison, lru and static)
    policies: tuple[str, ...] = field(default_factory=compared_policies)
    calibration: Path | None = None
    profile: Path | None = None  # this machine's profile for the projections (None: none are made)
    alloc: str | None = None  # "equal", "dp"; None: dp when the calibration has a routing trace
    compare_overlap: bool = False  # also run each policy with CPU/GPU overlap off ("... no-overlap" rows)
    # also run the assignable policies with this CPU/GPU assigner ("... +assign ratio" rows), priced by `profile`
    assign: str | None = None
    # also run each policy with prefill ubatches of this many tokens on the device ("... +device prefill" rows,
    # the two prefill buffers come out of the slots' budget); 0: not
    device_prefill: int = 0
    device_prefill_borrow: bool = False  # also a '+device prefill borrow' row: its buffers in borrowed slots
    # also run each policy with DAOP's pre-calculation from this layer ("... +precalc L" rows); None: not
    precalc_from: int | None = None
    flash_attn: FlashAttn = "auto"  # every row's (LoadConfig's)
    cache_type_k: KvCacheType = "f16"  # every row's KV cache types; the plan reserves that cache
    cache_type_v: KvCacheType = "f16"
    # also run the best stock row and each policy's first row with this speculative decoding ("... +lookup" rows)
    speculation: SpeculationConfig | None = None
    # every row's prefill ubatch (-ub); None: on a GPU with a GPU profile the prefill plan's for stock and +device
    # prefill rows, else 512
    n_ubatch: int | None = None
    kld_base: Path | None = None  # each output-changing row's KL divergence against it (bench.kld_column)

    @property
    def kv(self) -> KvTypes:
        return KvTypes(self.cache_type_k, self.cache_type_v)


def bench_ctx(spec: BenchSpec) -> int:
    """Every row's context: the spec's, else the prompt and the generated tokens rounded up to 256."""
    return spec.n_ctx or -(-(spec.prompt_tokens + spec.gen_tokens + 16) // 256) * 256


@dataclass(frozen=True)
class BenchUbatches:
    stock: int = PLAN_UBATCH  # the stock rows' -ub
    cache: int = PLAN_UBATCH  # the edgemoe rows' -ub (the +device prefill rows': plan()'s pick, or this)
    note: str = ""  # how they were picked (empty: llama.cpp's default)


def bench_ubatches(
    header: GgufHeader, spec: BenchSpec, n_ctx: int, pricing: ProfilePricing | None
) -> BenchUbatches:
    """The rows' ubatches (see the module's docstring); `pricing`: a GPU machine's prefill model (None: no GPU or
    no GPU profile)."""
    if spec.n_ubatch is not None:
        u = min(spec.n_ubatch, n_ctx)
        return BenchUbatches(u, u, f"every row at -ub {u} (given)")
    if pricing is None:
        return BenchUbatches()
    q = _question(spec, n_ctx, borrow=False)
    stock, ours = pricing.stock_ubatch(header, q), pricing.pick_ubatch(header, q)
    s_ub = stock.n_ubatch if stock is not None else PLAN_UBATCH
    note = f"-ub planned on {pricing.name} for a {q.prompt_tokens}-token prompt: stock {s_ub}"
    note += f" (--n-cpu-moe {stock.n_cpu_moe if stock is not None else None}), "
    note += f"+device prefill {ours.n_ubatch if ours is not None else PLAN_UBATCH}"
    return BenchUbatches(min(s_ub, n_ctx), PLAN_UBATCH, note)


def _question(spec: BenchSpec, n_ctx: int, *, borrow: bool) -> PrefillQuestion:
    fa = spec.flash_attn != "off"
    return PrefillQuestion(spec.vram, n_ctx, min(spec.prompt_tokens, n_ctx), fa, spec.kv, borrow)


@dataclass(frozen=True)
class RowPlanner:
    """What every row of a bench shares: plan() with the bench's model, context, device and load settings."""

    header: GgufHeader
    spec: BenchSpec
    n_ctx: int
    device: Device | None
    ubatches: BenchUbatches
    pricing: ProfilePricing | None = None  # the +device prefill rows' ubatch (None: the bench's)
    costs: dict[int, Any] | None = None  # the assigner's costs (--assign)

    @property
    def info(self) -> ModelInfo:
        return model_info(self.header)

    def load(self, n_ubatch: int, **more: Any) -> dict[str, Any]:
        s = self.spec
        n_gpu = 999 if self.device is not None else 0
        return dict(
            n_threads=s.threads, n_gpu_layers=n_gpu, flash_attn=s.flash_attn, cache_type_k=s.cache_type_k,
            cache_type_v=s.cache_type_v, n_ubatch=min(n_ubatch, self.n_ctx), **more,
        )  # fmt: skip

    def plan(self, request: Any, n_ubatch: int | None, **more: Any) -> PlacementPlan:
        """The row's plan at n_ubatch (None: the one plan() picks with the bench's pricing)."""
        load = self.load(n_ubatch if n_ubatch is not None else self.ubatches.cache, **more)
        if n_ubatch is None:
            load.pop("n_ubatch")
        pricing = self.pricing if n_ubatch is None else None
        return plan(
            self.header, request, n_ctx=self.n_ctx, device=self.device, profile=pricing,
            calibration=self.spec.calibration, **load,
        )  # fmt: skip


def stock_rows(rp: RowPlanner, *, mtp: bool = False) -> list[BenchRow]:
    """Stock's rows at stock's -ub: every expert in CPU memory (-ot exps=CPU), and on a GPU the best --n-cpu-moe
    beside that compute buffer (and the MTP heads' context with `mtp`) where it keeps some experts there."""
    u, moe = rp.ubatches.stock, tuple(rp.info.moe_layers)
    on_gpu = rp.device is not None
    sim = "stock-ot-exps-cpu" if on_gpu else "stock-cpu"
    extra = {"load_mtp": True} if mtp else {}
    cpu_all = rp.plan(None, u, cpu_expert_layers=moe if on_gpu else None, **extra)
    rows = [BenchRow("stock -ot exps=CPU", "stock", cpu_all, projection=Projection(sim, u))]
    n_cpu = rp.plan(budget_request(rp.spec.vram), u, **extra).n_cpu_moe if on_gpu else None
    n_cpu = len(moe) if on_gpu and n_cpu is None else n_cpu
    if n_cpu is not None and n_cpu < len(moe):
        p = rp.plan(None, u, cpu_expert_layers=moe[:n_cpu] or None, **extra)
        proj = Projection(f"stock-n-cpu-moe-{n_cpu}", u, n_cpu_moe=n_cpu, policies=())
        rows.append(BenchRow(f"stock --n-cpu-moe {n_cpu}", "stock", p, projection=proj))
    return rows


def _cache(rp: RowPlanner, pol: str, p: PlacementPlan, req: CacheRequest) -> tuple[CacheConfig, list[str]]:
    """The row's expert cache from its plan's slots (allocated by the spec's alloc over the plan's bytes) and its
    request's device prefill and pre-calculation, as install_cache sets them, with the notes the allocation
    leaves; raises EdgeMoeError where the allocation cannot be made."""
    assert p.slots_per_layer is not None
    allocation = allocate_slots(
        rp.info, alloc=rp.spec.alloc, policy=pol, calibration=rp.spec.calibration,
        slots_per_layer=p.slots_per_layer, budget_bytes=p.expert_budget_bytes,
    )  # fmt: skip
    slots = p.slots_per_layer if allocation.alloc == "equal" else allocation.slots
    cfg = CacheConfig(
        slots, policy=calibrated_config(pol, rp.spec.calibration), alloc=allocation.alloc,
        prefill_min_tokens=req.device_prefill, prefill_ahead=req.device_prefill_ahead,
        prefill_borrow=req.device_prefill_borrow, precalc_from=req.precalc_from,
    )  # fmt: skip
    notes = ([] if rp.device is not None else ["cache on the CPU stand-in"]) + (
        [allocation.note] if allocation.note else []
    )
    return cfg, notes


Variant = Callable[[CacheConfig], CacheConfig]


def policy_row(
    rp: RowPlanner, pol: str, suffix: str = "", *, request: dict[str, Any] | None = None, pick: bool = False,
    variant: Variant | None = None, tiers: bool = False, note: str = "", **load: Any,
) -> BenchRow:  # fmt: skip
    """The one builder of an edgemoe row: plan() for the policy's request (with `request`'s options) at the
    bench's ubatch (`pick`: the one plan() picks with the bench's pricing, where it has one), its cache from the
    plan's slots, changed by `variant`; a row that cannot be planned or allocated is kept with its reason."""
    asked = {"vram": rp.spec.vram, "policy": pol, "context_tiers": tiers, **(request or {})}
    u = None if pick and rp.pricing is not None else rp.ubatches.cache
    try:
        req = cache_request(**asked)
        p = rp.plan(req, u, **load)
        if p.whole_model_fits and p.budget is not None:  # the bench measures the cache: one of every slot
            whole = {k: v for k, v in asked.items() if k not in ("vram", "context_tiers")}
            req = cache_request(expert_slots=p.budget.experts_per_layer, **whole)
            p = rp.plan(req, u, **load)
        cfg, notes = _cache(rp, pol, p, req)
    except EdgeMoeError as err:  # reported as the policy's row, skipped
        return BenchRow(f"edgemoe {pol}{suffix}", "edgemoe", _stock_plan(rp), skip=str(err))
    name = f"edgemoe {pol}" + (" dp" if cfg is not None and cfg.alloc == "dp" else "") + suffix
    if cfg is not None and variant is not None:
        cfg = variant(cfg)
    steps = p.context_steps if cfg is not None else ()
    s = rp.spec
    stepped = (
        engine_tiers(rp.info, steps, p.n_ctx, cfg, alloc=s.alloc, policy=pol, calibration=s.calibration)
        if steps and cfg is not None
        else None
    )
    return BenchRow(name, "edgemoe", p, cfg, tiers=stepped, note="; ".join([*notes, note] if note else notes))


def _stock_plan(rp: RowPlanner) -> PlacementPlan:
    return rp.plan(None, PLAN_UBATCH)


def policy_rows(rp: RowPlanner, pol: str) -> list[BenchRow]:
    """The rows of one policy: with and without the overlap (--compare-overlap), then +assign, +device prefill,
    +device prefill borrow, +tiers and +precalc where the spec asks for them."""
    spec, on_gpu = rp.spec, rp.device is not None
    first = policy_row(rp, pol)
    if first.skip is not None:
        return [first]
    dp = first.cache is not None and first.cache.alloc == "dp"
    projected = on_gpu and not dp and policy_spec(pol).projected
    rows = [replace(first, projection=Projection(f"edgemoe-{pol}", first.placement.load.n_ubatch))
            if projected else first]  # fmt: skip
    if spec.compare_overlap:
        rows.append(policy_row(rp, pol, " no-overlap", variant=lambda c: replace(c, overlap=False)))
    if rp.costs is not None and policy_spec(pol).assignable:
        assigned = calibrated_config(pol, spec.calibration, assign=spec.assign, assign_costs=rp.costs)
        rows.append(
            policy_row(
                rp,
                pol,
                f" +assign {spec.assign}",
                variant=lambda c: replace(c, policy=assigned),
                note="in the routing hook",
            )  # fmt: skip
        )
    if spec.device_prefill:
        rows.append(_device_prefill_row(rp, pol, projected))
    if spec.device_prefill and spec.device_prefill_borrow:
        req = {"device_prefill": spec.device_prefill, "device_prefill_borrow": True}
        rows.append(
            policy_row(
                rp,
                pol,
                " +device prefill borrow",
                request=req,
                pick=True,
                note="every slot kept: the prefill buffers borrow the last layers' slots",
            )
        )
    if spec.context_tiers:
        tiered = policy_row(rp, pol, " +tiers", tiers=True)
        steps = tiered.placement.context_steps
        if steps:
            rows.append(
                replace(
                    tiered,
                    note="; ".join(
                        [tiered.note, "steps " + "/".join(f"{s.n_ctx}:{s.slots_per_layer}" for s in steps)]
                    ).lstrip("; "),
                )
            )
    if spec.precalc_from is not None:
        row = policy_row(
            rp, pol, f" +precalc {spec.precalc_from}", request={"precalc_from": spec.precalc_from}
        )
        proj = Projection(f"edgemoe-{pol}-precalc", row.placement.load.n_ubatch, policies=(pol,),
                          precalc_from=spec.precalc_from)  # fmt: skip
        rows.append(replace(row, projection=proj) if on_gpu and not dp and row.skip is None else row)
    return rows


def _device_prefill_row(rp: RowPlanner, pol: str, projected: bool) -> BenchRow:
    """The +device prefill row: the slots plan() leaves beside the two buffers, at the ubatch it picks."""
    req = {"device_prefill": rp.spec.device_prefill}
    row = policy_row(rp, pol, " +device prefill", request=req, pick=True)
    if row.skip is not None or row.cache is None:
        return row
    slots = row.cache.slots(rp.info.moe_layers, rp.info.n_expert)
    per_layer = sum(slots.values()) // max(1, len(slots))
    row = replace(
        row, note="; ".join(x for x in (row.note, f"{per_layer} slots/layer beside the prefill buffers") if x)
    )
    if not projected:
        return row
    u = row.placement.load.n_ubatch
    proj = Projection(f"edgemoe-{pol}-device-prefill", u, policies=(pol,), device_prefill_slots=slots)
    return replace(row, projection=proj)


def speculating(row: BenchRow, speculation: SpeculationConfig) -> BenchRow:
    """`row` again with speculative decoding ("... +lookup"; not projected)."""
    return replace(row, name=f"{row.name} +{speculation.mode}", speculation=speculation, projection=None)


def bench_rows(rp: RowPlanner) -> list[BenchRow]:
    """Every row of the bench, in order: stock's, each policy's, then the speculation rows (the best stock layout
    and each policy's first row again; with `mtp` planned beside the MTP heads)."""
    spec = rp.spec
    policies = spec.policies
    stock = stock_rows(rp)
    rows, again = list(stock), stock[-1:]
    for pol in policies:
        mine = policy_rows(rp, pol)
        again.append(mine[0])
        rows += mine
    sp = spec.speculation
    if sp is not None and sp.on:
        if sp.mode == "mtp":  # the MTP heads' reserve comes out of the slots and stock's GPU layers
            again = stock_rows(rp, mtp=True)[-1:] + [_beside_heads(rp, pol) for pol in policies]
        rows += [speculating(r, sp) for r in again]
    return rows


def _beside_heads(rp: RowPlanner, pol: str) -> BenchRow:
    row = policy_row(rp, pol, load_mtp=True)
    p = row.placement
    if row.skip is not None or p.slots_per_layer is None:
        return row
    load = p.load
    mtp = mtp_reserve_bytes(rp.info, p.n_ctx, load.n_ubatch, rp.spec.kv, flash_attn=load.flash_attn != "off")
    note = f"{p.slots_per_layer} slots/layer beside the MTP heads ({mtp / 2**20:.0f} MiB)"
    return replace(row, note="; ".join(x for x in (row.note, note) if x))
