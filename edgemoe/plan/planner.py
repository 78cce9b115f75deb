"""edgemoe.plan.plan(): a model, a cache request, a context and a target device to one PlacementPlan, computed
once, before anything is loaded: the engine's load config (its prefill ubatch included), whether the whole model
fits the budget, the expert slots and what the budget holds at the engine's context, the calibration stages still
to make, and the notes for the user.

edgemoe.placement.open_engine loads from it; `edgemoe inspect`, `plan`, bench and simulate print or consume it. It
calls no native library: the device is a plain description (edgemoe.placement.this_device() makes the one of
this build), the prefill model a protocol (edgemoe.plan.ubatch). As vLLM sizes its KV cache: free memory measured
once, turned into one config, handed to everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo, format_size, model_info
from ..gguf.kv_types import FlashAttn, KvTypes
from ..policies.daop import precalc_targets
from ..runtime.cache_config import checked_slots
from ..runtime.config import DEFAULT_BATCH, LoadConfig, LoadOptions, check_batches
from ..runtime.tier_rules import tiers_refusal
from .budget import (
    SlotBudget,
    best_n_cpu_moe,
    borrow_fits,
    engine_ctx,
    estimate_kv_cache_bytes,
    holds_every_expert,
    prefill_buffer_bytes,
    slot_budget,
)
from .calibration import NO_NEED, CalibrationNeed, calibration_need
from .context import ContextChoice, ContextTable, context_table, default_context
from .request import CacheRequest, PlacementError, cache_request
from .reserve import ComputeMeasure, Reserve, mtp_reserve_bytes, reserve_bytes, ubatch_reserve_bytes
from .tiers import TierStep, context_steps, describe_steps
from .ubatch import (
    DEFAULT_REASON,
    GIVEN_REASON,
    PrefillPricing,
    PrefillQuestion,
    UbatchPick,
    planned_prompt,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11


@dataclass(frozen=True)
class Device:
    """The GPU a plan places on (None in its place: a CPU-only build, where the cache runs on a CPU stand-in)."""

    name: str  # the ggml device's name, e.g. "CUDA0"
    free_bytes: int | None = None  # its free memory when measured (None: not measured)
    # llama.cpp's compute buffers on it for this model, measured (None: estimated; edgemoe.plan.reserve)
    compute: ComputeMeasure | None = None


@dataclass(frozen=True)
class PlacementPlan:
    """How a model is placed for a cache request at a context; made by plan(), once per open."""

    load: LoadConfig  # the engine's load config (n_ctx as asked: llama.cpp pads it to n_ctx below)
    n_ctx: int  # the context the engine gets: the model's default for 0, in llama.cpp's steps of 256
    is_moe: bool
    device: Device | None  # the GPU it places on (None: no GPU; a cache then runs on a CPU stand-in)
    whole_model_fits: bool  # the budget holds every weight: loaded as stock -ngl 999, without an expert cache
    cache: bool  # an expert cache is installed
    slots_per_layer: int | None  # equal expert slots per MoE layer (None: no cache)
    slot_bytes: int  # one expert slot in every MoE layer together
    kv_cache_bytes: int  # the KV cache at n_ctx
    reserve_bytes: int  # kept out of the slots at n_ctx: edgemoe.plan.reserve.reserve_bytes
    budget: SlotBudget | None  # how the request's budget splits at n_ctx (None: no --vram)
    n_cpu_moe: int | None  # stock llama.cpp's best --n-cpu-moe at the budget (None: no budget, or never fits)
    calibration: CalibrationNeed
    notes: tuple[str, ...]  # for the user, in order (open_engine sends them to `notify`)
    # a budget's context length x KV type -> expert slots (None: no budget, or a dense model)
    context_table: ContextTable | None = None
    # the context created in steps, each with its slots, the last n_ctx (): the whole context from the start
    context_steps: tuple[TierStep, ...] = ()
    # the tokens per prefill ubatch the engine runs (load.n_ubatch, at most the context) and why: given, the
    # default, or picked for a long prompt by the prefill model plan() was given (edgemoe.plan.ubatch)
    prefill_ubatch: int = DEFAULT_BATCH
    prefill_ubatch_reason: str = DEFAULT_REASON

    @property
    def expert_budget_bytes(self) -> int | None:
        """The bytes the budget leaves the expert slots (None without a budget): dp splits the same bytes."""
        return self.budget.expert_budget_bytes if self.budget is not None else None


def budget_request(vram: int) -> CacheRequest:
    """A request for the budget's split alone (inspect, plan, bench and simulate project every policy
    themselves): the manual policy, which reads no calibration."""
    return cache_request(vram=vram, policy="manual")


def plan(
    header: GgufHeader,
    request: CacheRequest | None,
    *,
    n_ctx: int,
    device: Device | None,
    profile: PrefillPricing | None = None,
    calibration: Path | None = None,
    **load: Unpack[LoadOptions],
) -> PlacementPlan:
    """The placement of `header`'s model for `request` (None: stock llama.cpp) at a context of `n_ctx` tokens (0:
    for a budget, the context edgemoe.plan.context.default_context picks, said in a note; else the model's, at
    most 4096) on `device` (None: no GPU), loaded with `load` (LoadConfig's threads, layers, flash attention, KV
    cache types, batch and ubatch; the budget reserves a KV cache of those types and the ubatch's compute buffer).
    `profile`: what prices device prefill on the machine (edgemoe.plan.ubatch.PrefillPricing); with a budget and
    device prefill and no `n_ubatch` given, the plan opens at the ubatch it picks, its larger compute buffer out of
    the slots (else 512). `calibration`: the directory to use (None: the model's). The one writer of a plan: nothing
    edits it afterwards. Raises PlacementError for a request this model cannot run, before anything is loaded."""
    opts = LoadConfig(**load)  # the load settings given, LoadConfig's defaults for the rest
    info = model_info(header)
    req = request if request is not None and request.enabled else None
    kv = KvTypes(opts.cache_type_k, opts.cache_type_v)
    given = load.get("n_ubatch")
    what = _reserve(opts, req, device, given)
    table, choice = _contexts(info, req, n_ctx, what, opts.flash_attn)
    asked = choice.n_ctx if choice is not None else n_ctx
    ctx = engine_ctx(asked, info.n_ctx_train)
    n_batch, n_ubatch = _batches(load, ctx)
    stock = replace(what, n_ubatch=min(n_ubatch, ctx), device_prefill=False)  # stock drafts with MTP too
    what = replace(what, n_ubatch=min(n_ubatch, ctx))
    budget = _split(info, req, ctx, what)
    whole = bool(
        req and info.is_moe and budget is not None and holds_every_expert(info, budget, what.device_prefill)
    )
    cache = req is not None and info.is_moe and not whole
    pick = _pick(header, req, ctx, what, profile) if cache and given is None else None
    if pick is not None:  # the larger compute buffer comes out of the slots
        what = replace(what, n_ubatch=min(pick.n_ubatch, ctx))
        n_batch, n_ubatch = max(n_batch, what.n_ubatch), what.n_ubatch
        budget = _split(info, req, ctx, what)
    slots = _slots(info, req, budget) if cache and req is not None else None
    steps, refusal = (
        _steps(header, info, req, ctx, n_batch, what) if cache and req is not None else ((), None)
    )
    if slots is not None and req is not None and req.device_prefill_borrow:
        check_borrow_fits(info, slots)
    base = replace(opts, n_ctx=asked, n_batch=n_batch, n_ubatch=n_ubatch)
    vram = req.vram if req is not None else None
    fa, u = what.flash_attn, what.n_ubatch
    mtp = mtp_reserve_bytes(info, ctx, u, kv, flash_attn=fa, measured=what.measured) if what.mtp else 0
    return PlacementPlan(
        load=_load_config(base, info, req, device, whole),
        n_ctx=ctx,
        is_moe=info.is_moe,
        device=device,
        whole_model_fits=whole,
        cache=cache,
        slots_per_layer=slots,
        slot_bytes=info.slot_bytes,
        kv_cache_bytes=estimate_kv_cache_bytes(info, ctx, kv),
        reserve_bytes=reserve_bytes(info, ctx, what),
        budget=budget,
        n_cpu_moe=best_n_cpu_moe(info, vram, ctx, kv, reserve_bytes=reserve_bytes(info, ctx, stock))
        if vram is not None
        else None,
        calibration=calibration_need(header.path, req, calibration) if cache and req is not None else NO_NEED,
        notes=tuple(_notes(header.path, info, req, n_ctx, ctx, whole, device))
        + ((choice.note,) if choice is not None else ())
        + ((describe_steps(steps, vram),) if steps and vram is not None else ())
        + ((f"note: the context is created whole (no context tiers): {refusal}",) if refusal else ())
        + ((_mtp_note(mtp),) if mtp and budget is not None else ())
        + ((_ubatch_note(info, ctx, what, slots),) if pick is not None else ()),
        context_table=table,
        context_steps=steps,
        prefill_ubatch=min(n_ubatch, ctx),
        prefill_ubatch_reason=pick.reason if pick else GIVEN_REASON if given is not None else DEFAULT_REASON,
    )


def _reserve(opts: LoadConfig, req: CacheRequest | None, device: Device | None, given: int | None) -> Reserve:
    """What the budget reserves beside the slots before the context and ubatch are settled (`given`: the
    ubatch asked for, None: llama.cpp's default batch until the plan picks one)."""
    return Reserve(
        n_ubatch=given if given is not None else DEFAULT_BATCH,
        flash_attn=opts.flash_attn != "off",
        kv=KvTypes(opts.cache_type_k, opts.cache_type_v),
        device_prefill=bool(req and req.reserves_prefill_buffers),  # borrowed ones cost no budget
        mtp=opts.load_mtp,  # the MTP heads' draft context, where loaded
        measured=device.compute if device is not None else None,
    )


def _split(info: ModelInfo, req: CacheRequest | None, ctx: int, what: Reserve) -> SlotBudget | None:
    """How the request's budget splits at ctx beside the reserve (None: no budget)."""
    if req is None or req.vram is None:
        return None
    return slot_budget(info, req.vram, n_ctx=ctx, reserve_bytes=reserve_bytes(info, ctx, what), kv=what.kv)


def _pick(
    header: GgufHeader, req: CacheRequest | None, ctx: int, what: Reserve, profile: PrefillPricing | None
) -> UbatchPick | None:
    """The prefill model's ubatch for a budget with device prefill (None: not asked, or none fits)."""
    if profile is None or req is None or req.vram is None or not req.device_prefill:
        return None
    question = PrefillQuestion(
        req.vram, ctx, planned_prompt(ctx), what.flash_attn, what.kv, req.device_prefill_borrow
    )
    return profile.pick_ubatch(header, question)


def _steps(
    header: GgufHeader, info: ModelInfo, req: CacheRequest, ctx: int, n_batch: int, what: Reserve
) -> tuple[tuple[TierStep, ...], str | None]:
    """A budget's context steps (tiers), each keeping the plan's reserve out of its slots, and why the model
    refuses them (None: it does not)."""
    if req.vram is None or req.expert_slots is not None or not req.context_tiers:
        return (), None
    refusal = tiers_refusal(header)
    if refusal is not None:
        return (), refusal
    return context_steps(info, req.vram, ctx, what.kv, n_batch=n_batch, reserve=what), None


def _ubatch_note(info: ModelInfo, ctx: int, what: Reserve, slots: int | None) -> str:
    extra = ubatch_reserve_bytes(info, ctx, what.n_ubatch, flash_attn=what.flash_attn)
    return (
        f"note: prefill ubatch {what.n_ubatch} (`n_ubatch`; the compute buffer takes {extra / 2**20:.0f} MiB more "
        f"out of the budget, {slots} expert slots per MoE layer); give `n_ubatch` to choose another"
    )


def _mtp_note(nbytes: int) -> str:
    return (
        f"note: the MTP heads take {format_size(nbytes)} of the budget (their weights but the routed experts, the "
        "draft context's compute buffer and KV cache)"
    )


def _batches(load: LoadOptions, ctx: int) -> tuple[int, int]:
    """(n_batch, n_ubatch) of the load options, each checked where given; a ubatch given alone gets a batch that
    holds it (llama.cpp would clamp the ubatch to the batch instead)."""
    batch, ubatch = load.get("n_batch"), load.get("n_ubatch")
    check_batches(batch, ubatch, ctx)
    n_ubatch = ubatch if ubatch is not None else DEFAULT_BATCH
    n_batch = batch if batch is not None else max(DEFAULT_BATCH, n_ubatch)
    return n_batch, min(n_ubatch, n_batch)


def _contexts(
    info: ModelInfo, req: CacheRequest | None, n_ctx: int, what: Reserve, flash_attn: FlashAttn
) -> tuple[ContextTable | None, ContextChoice | None]:
    """A budget's context x KV type table, and the context picked for it where none is asked (n_ctx 0), both with
    the plan's reserve (its ubatch, device prefill's buffers, the MTP heads)."""
    if req is None or req.vram is None:
        return None, None
    table = context_table(info, req.vram, flash_attn=flash_attn, reserve=what)
    choice = default_context(info, req.vram, what.kv, reserve=what) if not n_ctx else None
    return table, choice


def check_borrow_fits(info: ModelInfo, slots_per_layer: int) -> None:
    """`device_prefill_borrow` needs the slots of the last cached layers to hold device prefill's two buffers."""
    if not borrow_fits(info, slots_per_layer):
        need = prefill_buffer_bytes(info) / 2**20
        raise PlacementError(
            f"`device_prefill_borrow`: {slots_per_layer} slot(s) in each of the {len(info.moe_layers)} MoE layers "
            f"cannot hold device prefill's two buffers ({need:.0f} MiB, a whole layer's experts each): give "
            "more `vram`/`expert_slots` or leave `device_prefill_borrow` off"
        )


def check_precalc_from(info: ModelInfo, first_layer: int) -> None:
    """precalc_from must leave a MoE layer that follows a MoE layer (else it would do nothing)."""
    moe = list(info.moe_layers)
    if not precalc_targets(moe, first_layer):
        raise PlacementError(
            f"`precalc_from={first_layer!r}`: no MoE layer from there on follows a MoE layer "
            f"(this model's MoE layers: {moe[0]}..{moe[-1]}); give a smaller layer"
        )


def _slots(info: ModelInfo, req: CacheRequest, budget: SlotBudget | None) -> int:
    """Expert slots per MoE layer, the request's or what its budget leaves, checked in range; the request's
    precalc_from checked against the model's MoE layers."""
    if req.precalc_from is not None:
        check_precalc_from(info, req.precalc_from)
    slots = req.expert_slots if req.expert_slots is not None else budget.experts_per_layer if budget else 0
    checked_slots(slots, list(info.moe_layers), info.n_expert)
    return slots


def _load_config(
    base: LoadConfig, info: ModelInfo, req: CacheRequest | None, device: Device | None, whole: bool
) -> LoadConfig:
    """On a GPU with a cache request: every layer on the GPU, and the experts in CPU memory unless the budget
    holds the whole model."""
    if req is None or device is None:
        return base
    if whole:
        return replace(base, n_gpu_layers=999)
    return replace(base, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))


def _notes(
    model: Path,
    info: ModelInfo,
    req: CacheRequest | None,
    n_ctx: int,
    ctx: int,
    whole: bool,
    device: Device | None,
) -> list[str]:
    notes = []
    if n_ctx and ctx != n_ctx:
        notes.append(
            f"note: the context is {ctx} tokens (llama.cpp sizes it in steps of 256; a context of {n_ctx} was asked)"
        )
    if not info.is_moe:
        notes.append(
            f"note: {model.name} is a dense model (no routed experts); edgemoe's MoE "
            "features are off and it runs as stock llama.cpp"
        )
    if whole and req is not None:
        where = "on the GPU" if device is not None else "as stock llama.cpp does (no GPU in this build)"
        notes.append(
            f"note: `vram={format_size(req.vram or 0)!r}` holds the whole model (every expert of every MoE "
            f"layer): it runs {where}, without an expert cache (`policy` and the cache's options have "
            "nothing to do); give `expert_slots` for a cache all the same"
        )
    return notes
