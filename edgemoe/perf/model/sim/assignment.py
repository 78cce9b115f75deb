"""The prefill assignment (DALI's, edgemoe.policies.assignment by name): a prefill ubatch's experts split
between the CPU and the GPU (copying some) by an assigner; the two sides run at once."""

from __future__ import annotations

from ....policies.assignment import make_assigner
from ..costmodel import layer_cost_model
from ..workload import Step
from .feature import Acc, Feature, LayerTimes, MoeLayer
from .state import RunState


class Assignment(Feature):
    def __init__(self, assigner: str) -> None:
        self.assigner = assigner

    def overlaps(self, run: RunState, s: Step) -> bool:
        return bool(self.assigner) and s.n_tokens > 1

    def routed_layer(self, run: RunState, lay: MoeLayer, acc: Acc) -> LayerTimes | None:
        """(GPU time with the copies, CPU time with the hand-off, the wait for slots still loading, 0)."""
        if lay.n_tokens <= 1 or not lay.counts:
            return None
        assert run.gpu is not None and run.prof.link is not None
        il, counts = lay.il, lay.counts
        cost = layer_cost_model(run.cpu, run.gpu, run.prof.link, il, handoff_tokens=max(counts.values()))
        a = make_assigner(self.assigner)(counts, set(lay.gpu_e), cost)
        acc.cpu += a.t_cpu
        acc.gpu += a.t_gpu - a.t_transfer
        acc.pcie += len(a.load) * run.shape.expert_bytes(il)
        return a.t_gpu, a.t_cpu, lay.wait, 0.0
