"""The context tiers a budget plans (edgemoe.runtime.context_tiers runs them): the contexts of the plan's table
below the context asked for, each with the expert slots the budget leaves beside its smaller KV cache.

A step is kept only where it gives the slots more than the next step does (a step that gains nothing would only
cost a re-creation), and only from n_batch tokens up (a smaller context would shrink llama.cpp's batch). The last
step is the context asked for, with the plan's own slots. Pure arithmetic over a model's ModelInfo, as
edgemoe.plan.context is; edgemoe.placement turns the steps into the engine's tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..gguf.info import ModelInfo, format_size
from ..gguf.kv_types import KvTypes
from .budget import holds_every_expert, slot_budget
from .context import TABLE_CTX
from .reserve import PLAN_RESERVE, Reserve, reserve_bytes


@dataclass(frozen=True)
class TierStep:
    """One context step at a budget."""

    n_ctx: int
    slots_per_layer: int  # equal slots per MoE layer the budget leaves at n_ctx (n_expert: every expert fits)
    expert_budget_bytes: int  # the bytes those slots have (a dp allocation splits them)


def _step(info: ModelInfo, budget_bytes: int, n_ctx: int, reserve: Reserve) -> TierStep:
    sb = slot_budget(
        info, budget_bytes, n_ctx=n_ctx, reserve_bytes=reserve_bytes(info, n_ctx, reserve), kv=reserve.kv
    )
    slots = info.n_expert if holds_every_expert(info, sb, reserve.device_prefill) else sb.experts_per_layer
    return TierStep(n_ctx, slots, sb.expert_budget_bytes)


def context_steps(
    info: ModelInfo,
    budget_bytes: int,
    n_ctx: int,
    kv: KvTypes,
    *,
    n_batch: int = 512,
    reserve: Reserve = PLAN_RESERVE,
) -> tuple[TierStep, ...]:
    """The steps up to n_ctx (the engine's context) at `budget_bytes`, the last n_ctx itself; () where no smaller
    context gives a slot more (the whole context from the start). Each step keeps the plan's `reserve` (its
    ubatch's compute buffer, device prefill's buffers, the MTP heads) out of its slots at its own context."""
    reserve = replace(reserve, kv=kv)
    last = _step(info, budget_bytes, n_ctx, reserve)
    steps = [last]
    for c in sorted((c for c in TABLE_CTX if n_batch <= c < n_ctx), reverse=True):
        step = _step(info, budget_bytes, c, reserve)
        if step.slots_per_layer > steps[0].slots_per_layer:
            steps.insert(0, step)
    return tuple(steps) if len(steps) > 1 else ()


STEPS_NOTE = "the context grows in steps"


def describe_steps(steps: tuple[TierStep, ...], budget_bytes: int) -> str:
    """A note for the user: the steps and their slots."""
    ctx = " -> ".join(str(s.n_ctx) for s in steps)
    slots = " -> ".join(str(s.slots_per_layer) for s in steps)
    return (
        f"note: at `vram={format_size(budget_bytes)!r}` {STEPS_NOTE} {ctx} as the conversation "
        f"does, with {slots} expert slots per layer beside them (the KV cache a step does not use yet holds "
        "experts); `context_tiers=False` keeps the whole context from the start"
    )
