"""The hooks a simulated feature plugs into (`Feature`), the MoE layer they see (`MoeLayer`) and the
totals a step adds to (`Acc`).

A step's MoE layer on the GPU goes through four stages, each asking the run's features in order and
taking the first answer that is not None (a feature answers None where it does not apply):

1. `whole_layer`: the layer's experts before the expert cache sees its routing (stock's GPU layers);
2. `route`: the experts resident on the GPU (the expert cache); none answering: every expert is a miss;
3. `routed_layer`: the layer's experts after the routing, the misses included (the prefill assignment,
   --device-prefill);
4. `misses`: the experts outside the slots beside the resident ones on the GPU (op offload,
   pre-calculation, the decode split); none answering: on the CPU, with a hand-off each way.

Around them: `start` (once, before the first step), `begin_step`, `nodes` (graph nodes the feature adds
to a step), `layer_wait` (a wait before a layer's experts), `overlaps` (the layer's CPU and GPU branches
run at once) and `end_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..workload import Step
from .state import RunState


@dataclass
class Acc:
    """What a phase's steps add up to: time, each resource's busy time, bytes over the link, cache hits."""

    time: float = 0.0
    cpu: float = 0.0
    gpu: float = 0.0
    host: float = 0.0
    pcie: float = 0.0
    hits: int = 0
    misses: int = 0


@dataclass
class MoeLayer:
    """One MoE layer of one step on the GPU: its routing, when it starts and what the routing placed."""

    il: int  # model layer
    ids: Any  # (tokens, k) routed experts
    counts: dict[int, int]  # expert -> tokens routed to it
    step: Step
    t: float  # when the layer starts
    dense_s: float  # its dense part (attention, router)
    gpu_e: dict[int, int] = field(default_factory=dict)  # the routed experts resident on the GPU
    cpu_e: dict[int, int] = field(default_factory=dict)  # the others
    wait: float = 0.0  # for resident slots still loading

    @property
    def n_tokens(self) -> int:
        return self.step.n_tokens


# (GPU time, CPU time with its hand-offs, wait for slots still loading, CPU time of the experts
# pre-calculated for the layer with its hand-off)
LayerTimes = tuple[float, float, float, float]
# (GPU time, CPU time with its hand-offs, pre-calculated CPU time) of a layer with misses
MissTimes = tuple[float, float, float]


class Feature:
    """One feature of a simulated configuration; every hook's default leaves the run as it is."""

    def start(self, run: RunState) -> None:
        """Once, when the run is built (before the first step)."""

    def begin_step(self, run: RunState, s: Step) -> None:
        """When a step starts."""

    def nodes(self, run: RunState, s: Step) -> int:
        """Graph nodes the feature adds to step `s`."""
        return 0

    def whole_layer(self, run: RunState, lay: MoeLayer, acc: Acc) -> LayerTimes | None:
        """The layer's times where the feature runs all its experts, before the cache sees the routing."""
        return None

    def route(self, run: RunState, lay: MoeLayer, acc: Acc) -> dict[int, int] | None:
        """The routed experts resident on the GPU (expert -> tokens) where the feature keeps experts there."""
        return None

    def routed_layer(self, run: RunState, lay: MoeLayer, acc: Acc) -> LayerTimes | None:
        """The layer's times where the feature runs all its experts, once the routing placed them."""
        return None

    def misses(self, run: RunState, lay: MoeLayer, gpu_s: float, acc: Acc) -> MissTimes | None:
        """The layer's times where the feature runs its experts outside the slots (`lay.cpu_e`, not empty);
        `gpu_s` is the GPU's time for the resident ones."""
        return None

    def layer_wait(self, run: RunState, il: int, wait: float, acc: Acc) -> float:
        """The wait before layer `il`'s experts, given the wait so far."""
        return wait

    def overlaps(self, run: RunState, s: Step) -> bool:
        """Whether a layer's CPU branch runs while its GPU branch does in step `s`."""
        return False

    def end_step(self, run: RunState, t: float, acc: Acc) -> float:
        """When the step ends, given that its compute ends at `t`."""
        return t
