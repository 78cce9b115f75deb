"""The context tiers a budget plans (edgemoe.runtime.context_tiers runs them): the contexts of the plan's table
below the context asked for, each with the expert slots the budget leaves beside its smaller KV cache.

A step is kept only where it gives the slots more than the next step does (a step that gains nothing would only
cost a re-creation), and only from n_batch tokens up (a smaller context would shrink llama.cpp's batch). The last
step is the context asked for, with the plan's own slots. Pure arithmetic over a model's ModelInfo, as
edgemoe.placement.context is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..calibration.slot_alloc import allocate_slots
from ..gguf.info import ModelInfo, format_size
from ..gguf.kv_types import KvTypes
from ..runtime.cache_config import CacheConfig
from ..runtime.context_tiers import ContextTier, ContextTiers
from .budget import holds_every_expert, slot_budget, vram_reserve
from .context import TABLE_CTX


@dataclass(frozen=True)
class TierStep:
    """One context step at a budget."""

    n_ctx: int
    slots_per_layer: int  # equal slots per MoE layer the budget leaves at n_ctx (n_expert: every expert fits)
    expert_budget_bytes: int  # the bytes those slots have (a dp allocation splits them)


def _step(
    info: ModelInfo, budget_bytes: int, n_ctx: int, kv: KvTypes, device_prefill: bool, extra: int
) -> TierStep:
    reserve = vram_reserve(info, device_prefill) + extra
    sb = slot_budget(info, budget_bytes, n_ctx=n_ctx, reserve_bytes=reserve, kv=kv)
    slots = info.n_expert if holds_every_expert(info, sb, device_prefill) else sb.experts_per_layer
    return TierStep(n_ctx, slots, sb.expert_budget_bytes)


def context_steps(
    info: ModelInfo,
    budget_bytes: int,
    n_ctx: int,
    kv: KvTypes,
    *,
    device_prefill: bool = False,
    n_batch: int = 512,
    extra_reserve: Callable[[int], int] = lambda n_ctx: 0,
) -> tuple[TierStep, ...]:
    """The steps up to n_ctx (the engine's context) at `budget_bytes`, the last n_ctx itself; () where no smaller
    context gives a slot more (the whole context from the start). `extra_reserve(n_ctx)`: bytes kept out of the
    slots beyond the plan's reserve at that context (a larger prefill ubatch's compute buffer)."""
    last = _step(info, budget_bytes, n_ctx, kv, device_prefill, extra_reserve(n_ctx))
    steps = [last]
    for c in sorted((c for c in TABLE_CTX if n_batch <= c < n_ctx), reverse=True):
        step = _step(info, budget_bytes, c, kv, device_prefill, extra_reserve(c))
        if step.slots_per_layer > steps[0].slots_per_layer:
            steps.insert(0, step)
    return tuple(steps) if len(steps) > 1 else ()


def engine_tiers(
    info: ModelInfo,
    steps: tuple[TierStep, ...],
    n_ctx: int,
    cache: CacheConfig,
    **allocation: Any,
) -> ContextTiers:
    """The steps as the tiers of an engine of n_ctx tokens whose expert cache is `cache` (Engine.set_context_tiers):
    each step but the last with its slots allocated as the cache's were (equal, or `allocation`'s allocate_slots
    keywords, e.g. dp, over the step's bytes), then the engine's context with the cache's own slots."""

    def slots(step: TierStep) -> int | Mapping[int, int]:
        if cache.alloc == "equal":
            return step.slots_per_layer
        return allocate_slots(
            info, slots_per_layer=step.slots_per_layer, budget_bytes=step.expert_budget_bytes, **allocation
        ).slots

    return ContextTiers(
        (*(ContextTier(s.n_ctx, slots(s)) for s in steps[:-1]), ContextTier(n_ctx, cache.slots_per_layer))
    )


STEPS_NOTE = "the context grows in steps"  # how describe_steps' note is found again (a re-plan replaces it)


def describe_steps(steps: tuple[TierStep, ...], budget_bytes: int) -> str:
    """A note for the user: the steps and their slots."""
    ctx = " -> ".join(str(s.n_ctx) for s in steps)
    slots = " -> ".join(str(s.slots_per_layer) for s in steps)
    return (
        f"note: at `vram={format_size(budget_bytes)!r}` {STEPS_NOTE} {ctx} as the conversation "
        f"does, with {slots} expert slots per layer beside them (the KV cache a step does not use yet holds "
        "experts); `context_tiers=False` keeps the whole context from the start"
    )
