"""The decode split (FreeToken-style; not built): a step's experts outside the slots, below op offload's
batch size, by the decode-miss cost model (policies.assignment.decode_miss_costs, for the layer's misses
together): on the CPU; copied whole to the GPU and computed there (into scratch memory: the slots do not
change); or split by rows (split_share), the CPU computing a share f of each one's rows from host memory
while the link copies the other rows to the GPU, which computes them after the layer's resident experts;
whichever ends first. The copies go through the loader's staging buffers but not on the cache's copy
stream."""

from __future__ import annotations

from ....policies.assignment import split_share
from ..workload import Step
from .config import OFFLOAD_MIN_TOKENS, SPLIT_NODES_PER_LAYER
from .feature import Acc, Feature, MissTimes, MoeLayer
from .state import RunState


class DecodeSplit(Feature):
    def nodes(self, run: RunState, s: Step) -> int:
        return SPLIT_NODES_PER_LAYER * len(run.shape.moe_layers) if s.n_tokens < OFFLOAD_MIN_TOKENS else 0

    def misses(self, run: RunState, lay: MoeLayer, gpu_s: float, acc: Acc) -> MissTimes:
        """(the GPU side's time after the resident experts' `gpu_s`, the CPU side's with its hand-offs, 0)."""
        assert run.gpu is not None and run.prof.link is not None
        il, cpu_e = lay.il, lay.cpu_e
        hand = 2 * run.prof.link.latency_s
        nbytes = run.shape.expert_bytes(il) * len(cpu_e)
        cpu, gpu = run.cpu.experts(il, cpu_e), run.gpu.experts(il, cpu_e)
        wait = nbytes / run.prof.link.loads_bw + gpu
        f = split_share(cpu, wait, hand, gpu_s)
        if not 0.0 < f < 1.0:
            f = (
                1.0 if hand + cpu <= gpu_s + wait else 0.0
            )  # one side alone: the CPU, or the GPU after the copy
        acc.cpu += f * cpu
        acc.gpu += (1.0 - f) * gpu
        acc.pcie += (1.0 - f) * nbytes
        return gpu_s + (1.0 - f) * wait, (hand + f * cpu if f > 0.0 else 0.0), 0.0
