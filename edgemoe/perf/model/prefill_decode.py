"""Decode right after a long prompt, with device prefill's two buffers beside the slots and with them in the slots
of the last cached layers (--device-prefill-borrow): what borrowing costs or gives the first tokens.

Beside the slots, decode starts with the slots the budget leaves next to the buffers, the placement resident.
Borrowing, it starts with the slots of a budget without them; the lent layers get theirs back empty as decode
starts and refill them with the prompt's most routed experts over the copy stream, each on the CPU until its
load lands (sim/refill.py). Each side at the ubatch an engine opens with (prefill_plan.settled). Only policies
that place by routing counts are projected: the refill is such a placement. Every figure is a projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...analysis.trace import DECODE, Trace
from ...plan.reserve import PLAN_UBATCH
from ...policies.registry import policy_spec
from .costmodel import ModelShape
from .profile import MachineProfile
from .prompt_replay import replay_prompt
from .sim.config import Config
from .simulate import static_frequency
from .workload import Step, Workload, build_workload, prompt_workload

N_DECODE = 64  # the decode tokens after the prompt (the long-prompt goal's "the first 64 tokens")


@dataclass(frozen=True)
class SideSlots:
    """One side's settled prefill: its ubatch, the slots decode keeps, the layers lent while the prompt ran."""

    n_ubatch: int
    slots_per_layer: int
    lent_layers: int = 0


@dataclass(frozen=True)
class DecodeAfterPrompt:
    decode_tokens: int
    beside: SideSlots
    beside_tps: float  # decode tok/s over those tokens, the buffers beside the slots
    borrow: SideSlots
    borrow_tps: float  # the same tokens, the buffers in the last layers' slots while the prompt ran
    refill_bytes: int  # what the lent layers' refill copies
    refill_s: float  # at the loader's rate

    @property
    def ratio(self) -> float:
        """Borrowing's decode over the other's (1.05: 5% faster)."""
        return self.borrow_tps / self.beside_tps if self.beside_tps else 0.0


def decode_steps(trace: Trace, shape: ModelShape, *, kv_start: int, n: int) -> Workload:
    """`n` decode tokens after a `kv_start`-token prompt: the trace's decode tokens in order (repeated from the
    first when it has fewer), each over the prompt and the tokens before it."""
    moe = shape.moe_layers
    work = build_workload(trace, moe, shape.n_expert, shape.n_expert_used, n_ubatch=PLAN_UBATCH)
    ids = [s.ids for s in work.phase(DECODE)] or [s.ids for s in work.steps]
    rows = np.concatenate(ids)
    steps = tuple(Step(DECODE, 0, kv_start + i, rows[i % len(rows)][None]) for i in range(n))
    return Workload(steps, moe, shape.n_expert, work.note)


def decode_after_prompt(
    shape: ModelShape,
    trace: Trace,
    prof: MachineProfile,
    *,
    policy: str,
    frequency: dict[int, Any],
    nodes: tuple[int, int],
    prompt_tokens: int,
    beside: SideSlots,
    borrow: SideSlots,
    n_decode: int = N_DECODE,
) -> DecodeAfterPrompt | None:
    """Decode tok/s over the `n_decode` tokens after a `prompt_tokens`-token prompt on each side; `frequency`: the
    placement's routing counts (the lent layers take the prompt's own). None: `policy` does not place by counts."""
    if policy_spec(policy).frequency_phase is None or prof.link is None:
        return None
    moe = shape.moe_layers
    lent = frozenset(moe[len(moe) - borrow.lent_layers :])
    prompt = prompt_workload(
        trace, moe, shape.n_expert, shape.n_expert_used, n_tokens=prompt_tokens, n_ubatch=borrow.n_ubatch
    )
    counts = static_frequency(prompt)
    refilled = {il: counts[il] if il in lent else frequency[il] for il in moe}
    work = decode_steps(trace, shape, kv_start=prompt_tokens, n=n_decode)

    def tps(side: SideSlots, freq: dict[int, Any], refilling: frozenset[int]) -> float:
        slots = {il: side.slots_per_layer for il in moe}
        cfg = Config(f"edgemoe-{policy}", "edgemoe", policy=policy, slots=slots, refilling=refilling)
        return replay_prompt(shape, prof, cfg, work, nodes=nodes, frequency=freq)[0]

    refill_bytes = sum(min(borrow.slots_per_layer, shape.n_expert) * shape.expert_bytes(il) for il in lent)
    return DecodeAfterPrompt(
        n_decode,
        beside,
        tps(beside, frequency, frozenset()),
        borrow,
        tps(borrow, refilled, lent),
        refill_bytes,
        refill_bytes / prof.link.loads_bw,
    )
