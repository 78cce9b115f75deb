"""The prefill ubatch an engine opens with (issue 41): picked for a long prompt by the prefill plan
(edgemoe.perf.model.prefill_plan) from the budget and a machine profile, its larger compute buffer taken out of
the expert slots.

plan() (edgemoe.placement.planner) keeps llama.cpp's 512 unless -ub is given; with_prefill_ubatch turns a plan
with a budget and --device-prefill (whose copies per ubatch a larger ubatch amortizes; the prefill plan models
that prefill, not the CPU's) into one at the ubatch the prefill plan projects for a prompt as long as the context
holds (at most PLANNED_PROMPT tokens). A -ub given always wins.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..gguf.header import GgufHeader
from ..gguf.info import model_info
from ..gguf.kv_types import KvTypes
from .budget import slot_budget, ubatch_reserve_bytes, vram_reserve
from .planner import PlacementPlan, load_reserve_bytes
from .request import CacheRequest
from .tiers import STEPS_NOTE, context_steps, describe_steps

if TYPE_CHECKING:
    from ..perf.model.prefill_plan import PrefillChoice
    from ..perf.model.profile import MachineProfile

PLANNED_PROMPT = (
    8192  # the prompt length the ubatch is picked for (an agent's first request), at most the context
)


def machine_profile(name: str | None) -> MachineProfile | None:
    """The profile named (a bundled name or a file), else this machine's measured one (what `edgemoe plan`
    uses); None where there is none or it has no GPU (the prefill plan prices GPU prefill)."""
    from ..perf.measure.profiling import default_profile_path
    from ..perf.model.profile import load_profile

    if name is None:
        if not default_profile_path().exists():
            return None
        name = str(default_profile_path())
    prof = load_profile(name)
    return prof if prof.has_gpu else None


def with_prefill_ubatch(
    header: GgufHeader, placement: PlacementPlan, request: CacheRequest, prof: MachineProfile
) -> PlacementPlan:
    """`placement` at the prefill ubatch the prefill plan picks on `prof` (unchanged where -ub was given, where
    there is no budget or no expert cache, or where no ubatch fits): the load config's n_ubatch (and n_batch, to
    hold it), the slots beside the larger compute buffer, and a note that says why."""
    given = placement.prefill_ubatch_reason != PlacementPlan.prefill_ubatch_reason
    if given or request.vram is None or not request.device_prefill or not placement.cache:
        return placement
    choice = _choice(header, placement, request, prof)
    if choice is None:
        return placement
    from ..perf.model.prefill_plan import NEAR_FASTEST, settled

    best = settled(choice)
    u = min(best.n_ubatch, placement.n_ctx)
    info = model_info(header)
    load = placement.load
    # the MTP context's compute buffer grows with the ubatch too
    mtp = load_reserve_bytes(info, load, placement.n_ctx, u)
    reserve = vram_reserve(info, device_prefill=request.reserves_prefill_buffers) + mtp
    kv = KvTypes(load.cache_type_k, load.cache_type_v)
    extra = ubatch_reserve_bytes(info, placement.n_ctx, u, flash_attn=load.flash_attn != "off")
    budget = slot_budget(info, request.vram, n_ctx=placement.n_ctx, reserve_bytes=reserve + extra, kv=kv)
    slots = request.expert_slots if request.expert_slots is not None else budget.experts_per_layer
    why = (
        f"{choice.config} on {prof.name}, a {_prompt(placement)}-token prompt: -ub {u} is the smallest within "
        f"{NEAR_FASTEST:.0%} of the fastest projected prefill ({choice.reason})"
    )
    note = (
        f"note: prefill ubatch {u} (`n_ubatch`; the compute buffer takes {extra / 2**20:.0f} MiB more out of the budget, "
        f"{slots} expert slots per MoE layer); give `n_ubatch` to choose another"
    )
    n_batch = max(load.n_batch, u)
    steps, notes = placement.context_steps, placement.notes
    if steps:  # each context step keeps the larger compute buffer out of its slots too
        fa = load.flash_attn != "off"
        steps = context_steps(
            info,
            request.vram,
            placement.n_ctx,
            kv,
            device_prefill=request.reserves_prefill_buffers,
            n_batch=n_batch,
            extra_reserve=lambda c: ubatch_reserve_bytes(info, c, u, flash_attn=fa) + mtp,
        )
        notes = tuple(n for n in notes if STEPS_NOTE not in n)
        notes += (describe_steps(steps, request.vram),) if steps else ()
    return replace(
        placement,
        load=replace(load, n_batch=n_batch, n_ubatch=u),
        slots_per_layer=slots,
        budget=budget,
        reserve_bytes=placement.reserve_bytes + extra,
        prefill_ubatch=u,
        prefill_ubatch_reason=why,
        context_steps=steps,
        notes=(*notes, note),
    )


def _prompt(placement: PlacementPlan) -> int:
    return min(PLANNED_PROMPT, placement.n_ctx)


def _choice(
    header: GgufHeader, placement: PlacementPlan, request: CacheRequest, prof: MachineProfile
) -> PrefillChoice | None:
    """edgemoe's side with --device-prefill at its fastest ubatch; None where it does not fit the budget."""
    from ..analysis.routing_profile import routing_for_model
    from ..perf.model.costmodel import ModelShape
    from ..perf.model.prefill_plan import PrefillPlanner, PrefillSpec

    assert request.vram is not None
    shape = ModelShape.from_header(header)
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    load = placement.load
    spec = PrefillSpec(
        request.vram,
        placement.n_ctx,
        flash_attn=load.flash_attn != "off",
        kv=KvTypes(load.cache_type_k, load.cache_type_v),
    )
    projection = PrefillPlanner(shape, trace, prof, spec).project(_prompt(placement))
    borrow = request.device_prefill_borrow
    return next((c for c in projection.choices if c.kind == "edgemoe" and c.borrow == borrow), None)
