"""The gate (--gating): a decode step's MoE layers drop routed experts (the workload carries the gated
routing); the graph computes the gate's ids and weights in each MoE layer."""

from __future__ import annotations

from ....analysis.trace import DECODE
from ..workload import Step
from .config import GATE_NODES_PER_LAYER
from .feature import Feature
from .state import RunState


class Gate(Feature):
    def nodes(self, run: RunState, s: Step) -> int:
        return GATE_NODES_PER_LAYER * len(run.shape.moe_layers) if s.phase == DECODE else 0
