"""DAOP's pre-calculation (--precalc-from, `PrecalcSpec`): in a decode step, a share of a cached target
layer's CPU expert work is computed a layer early, starting with the layer while the GPU computes its
attention and router; the rest runs as before. Each split pays the expert products' fixed cost."""

from __future__ import annotations

from ....analysis.trace import DECODE
from ..workload import Step
from .config import PRECALC_NODES_PER_LAYER, PrecalcSpec
from .feature import Acc, Feature, MissTimes, MoeLayer
from .state import RunState


class Precalc(Feature):
    def __init__(self, spec: PrecalcSpec, layers: frozenset[int]) -> None:
        self.spec = spec
        # the cached layers whose CPU experts a decode step pre-calculates a layer early (a layer without slots
        # has no cache, and no tables to take the early results with)
        self.layers = layers

    def nodes(self, run: RunState, s: Step) -> int:
        return PRECALC_NODES_PER_LAYER * len(self.layers) if s.phase == DECODE and s.n_tokens == 1 else 0

    def misses(self, run: RunState, lay: MoeLayer, gpu_s: float, acc: Acc) -> MissTimes | None:
        """(the GPU's time, the late split's time with the hand-offs of the layer's CPU branch, the early
        split's time with the hand-off of its input)."""
        if lay.n_tokens != 1 or lay.il not in self.layers:
            return None
        assert run.prof.link is not None
        pc, lat, il, cpu_e = self.spec, run.prof.link.latency_s, lay.il, lay.cpu_e
        work = sum(run.cpu.expert(il, c) for c in cpu_e.values())
        fixed = run.cpu.expert_fixed(il, max(cpu_e.values()))
        early = fixed + work * (pc.recall + pc.wasted)
        late = fixed + work * (1.0 - pc.recall)
        acc.cpu += early + late
        return gpu_s, 2 * lat + late, lat + early
