"""Projected speeds for the context x KV type table of a budget (edgemoe.plan.context): each distinct slot
count of the table replayed once through the simulator (edgemoe.perf.model.simulate) with the default policy over
equal slots, and every row with that count takes its figures.

What is projected is the expert slots a context leaves: the replay runs the routing trace's own prompts, so the
attention over a longer context (which flash attention keeps cheap, and which grows with the tokens actually
in the KV cache, not with the context reserved) is not in these figures.
"""

from __future__ import annotations

from pathlib import Path

from ...analysis.trace import Trace
from ...gguf.info import ModelInfo
from ...plan.context import ContextTable
from ...plan.request import DEFAULT_POLICY
from .profile import MachineProfile
from .simulate import SimSpec, simulate


def project_context_table(
    model: str | Path,
    info: ModelInfo,
    table: ContextTable,
    trace: Trace,
    profile: MachineProfile,
    calibration: Path | None = None,
    *,
    policy: str = DEFAULT_POLICY,
) -> ContextTable:
    """`table` with projected decode and prefill tok/s of `policy` at each row's slots (equal in every MoE layer,
    CPU/GPU overlap on, as the build runs a cache on a GPU): one replay per distinct slot count. `calibration`: the
    static placement's (None: from the trace's first half, as `edgemoe simulate` does)."""
    speeds: dict[int, tuple[float, float]] = {}
    for n in table.slot_counts:
        spec = SimSpec(
            vram=table.budget_bytes,
            n_ctx=min(r.n_ctx for r in table.rows),
            policies=(policy,),
            calibration=calibration,
            slots={il: n for il in info.moe_layers},
            overlap=True,
        )
        ours = [c for c in simulate(model, trace, profile, spec).configs if c.kind == "edgemoe"]
        if ours:
            speeds[n] = (ours[0].decode_tps, ours[0].prefill_tps)
    what = f"{policy}, equal slots, profile {profile.name}; {len(speeds)} slot counts replayed"
    return table.with_speeds(speeds, what)
