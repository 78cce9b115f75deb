"""The work a routing trace asks of a model: its steps (prefill ubatches, decode tokens) and, per
MoE layer, the experts each step routes to, optionally after an adaptive top-k rule.

A trace may come from another model with the same routing shape (expert count, top-k), e.g. a
fixture's trace projected onto a full-size model of that shape: its MoE layers are then reused in
turn (model MoE layer j takes trace layer j mod L), and `Workload.note` says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ...analysis.trace import DECODE, PREFILL, Trace
from ...errors import EdgeMoeError
from ...policies.assignment import workload_from_ids
from ...policies.gating import GatingRule, keep_mask, normalised


@dataclass(frozen=True)
class GatingSpec:
    rule: GatingRule
    threshold: float
    decode_only: bool = True  # the runtime's default: prefill ubatches keep every routed expert

    @property
    def label(self) -> str:
        return f"{self.rule.value} {self.threshold:g}"


@dataclass(frozen=True)
class Step:
    phase: int  # PREFILL or DECODE
    seq: int
    kv_len: int  # tokens of the sequence already in the KV cache
    ids: np.ndarray  # (n_tokens, n_moe_layers, k) int32, -1 where a gate dropped the slot
    _counts: dict[int, dict[int, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def counts(self, j: int) -> dict[int, int]:
        """Tokens routed to each expert of MoE layer j (the ids' second axis) in this step."""
        if j not in self._counts:
            self._counts[j] = workload_from_ids(self.ids[:, j, :])
        return self._counts[j]


@dataclass(frozen=True)
class Workload:
    steps: tuple[Step, ...]
    moe_layers: tuple[int, ...]  # the model's MoE layers, in the order of ids' second axis
    n_expert: int
    note: str = ""

    def phase(self, phase: int) -> Iterator[Step]:
        return (s for s in self.steps if s.phase == phase)

    def tokens(self, phase: int) -> int:
        return sum(s.n_tokens for s in self.phase(phase))


def build_workload(
    trace: Trace,
    moe_layers: tuple[int, ...],
    n_expert: int,
    n_expert_used: int,
    *,
    n_ubatch: int = 512,
    gating: GatingSpec | None = None,
    first_seq: int = 0,
    verify: int = 1,
) -> Workload:
    """Steps of every sequence from `first_seq` on: prefill tokens in ubatches of n_ubatch, then one
    step per `verify` decode tokens (1: plain decoding; k + 1: speculation's verification of k proposals, the
    union of their experts read once). Refuses a trace of another routing shape."""
    if trace.n_expert != n_expert or trace.ids.shape[2] != n_expert_used:
        raise EdgeMoeError(
            f"the trace routes top-{trace.ids.shape[2]} of {trace.n_expert} experts, the model "
            f"top-{n_expert_used} of {n_expert}: record a trace of this model (`edgemoe trace`) "
            "or of one with the same expert count and top-k"
        )
    n_trace = len(trace.layers)
    pick = np.arange(len(moe_layers)) % n_trace
    note = (
        ""
        if n_trace == len(moe_layers)
        else (
            f"the trace has {n_trace} MoE layers, the model {len(moe_layers)}: model MoE layer j replays trace layer "
            f"j mod {n_trace}"
        )
    )
    ids = trace.ids[:, pick, :].astype(np.int32)
    if gating is not None:
        ids = _gate(ids, trace.weights[:, pick, :], trace.phase, gating)
    steps: list[Step] = []
    for seq in np.unique(trace.seq):
        if seq < first_seq:
            continue
        rows = np.flatnonzero(trace.seq == seq)
        pre = rows[trace.phase[rows] == PREFILL]
        for start in range(0, len(pre), n_ubatch):
            chunk = pre[start : start + n_ubatch]
            steps.append(Step(PREFILL, int(seq), start, ids[chunk]))
        dec = rows[trace.phase[rows] == DECODE]
        for i in range(0, len(dec), verify):
            steps.append(Step(DECODE, int(seq), len(pre) + i, ids[dec[i : i + verify]]))
    if not steps:
        raise EdgeMoeError("the trace has no tokens to replay")
    return Workload(tuple(steps), moe_layers, n_expert, note)


def _gate(ids: np.ndarray, weights: np.ndarray, phase: np.ndarray, g: GatingSpec) -> np.ndarray:
    """Drop the slots the rule drops (as the runtime's gate does, on the weights normalised to sum 1)."""
    if g.rule is GatingRule.SENSITIVITY:
        raise EdgeMoeError("the sensitivity rule needs per-layer sensitivities: simulate score or ser gating")
    out = ids.copy()
    t, n_layer, k = ids.shape
    rows = np.flatnonzero(phase == DECODE) if g.decode_only else np.arange(t)
    for j in range(n_layer):
        keep = keep_mask(g.rule, normalised(weights[rows, j, :]), g.threshold)
        sub = out[rows, j, :]
        sub[~keep] = -1
        out[rows, j, :] = sub
    return out


def prompt_workload(
    trace: Trace,
    moe_layers: tuple[int, ...],
    n_expert: int,
    n_expert_used: int,
    *,
    n_tokens: int,
    n_ubatch: int,
) -> Workload:
    """One prompt of `n_tokens` tokens prefilled in ubatches of `n_ubatch` (no decode): its routing is the trace's
    prefill tokens one sequence after another, repeated from the first when the trace has fewer (a trace of
    decode tokens only lends its decode tokens). Refuses a trace of another routing shape, as build_workload."""
    work = build_workload(trace, moe_layers, n_expert, n_expert_used, n_ubatch=max(1, trace.n_tokens))
    pre = [s.ids for s in work.phase(PREFILL)] or [s.ids for s in work.steps]
    rows = np.concatenate(pre)
    ids = rows[np.arange(n_tokens) % len(rows)]
    steps = tuple(
        Step(PREFILL, 0, start, ids[start : start + n_ubatch]) for start in range(0, n_tokens, n_ubatch)
    )
    drawn = f"a prompt's routing: the trace's {len(rows)} prefill tokens in order" + (
        ", repeated to its length" if len(rows) < n_tokens else ""
    )
    return Workload(steps, moe_layers, n_expert, "; ".join(x for x in (work.note, drawn) if x))
