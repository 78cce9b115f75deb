"""The expert cache: a residency policy places experts in the GPU's slots; the layer's routed experts in
a slot run on the GPU (a hit) once their load completes. The policy's loads go on the copy stream when the
step ends (a worker sends them while the next step computes), at once for a blocking policy (a miss waits
for its copy), or, where the engine leaves the load worker off (the RPC device: `load_worker_default`),
by the caller when it synchronises after the step, so their copy time ends that step on the host."""

from __future__ import annotations

from typing import Any

from ....policies.copy_queue import load_worker_default
from ....policies.residency import ResidencyPolicy
from ..workload import Step
from .config import CACHE_NODES_PER_LAYER
from .feature import Acc, Feature, MoeLayer
from .state import RunState


class ExpertCache(Feature):
    def __init__(self, policy: ResidencyPolicy) -> None:
        self.policy = policy
        self.pending: list[Any] = []  # the step's loads, queued when it ends
        self.caller_issues = False  # the caller sends the loads itself (no load worker on this device)

    def start(self, run: RunState) -> None:
        self.set_caller_issues(run)
        run.stream.queue(self.policy.initial_loads(), start=0.0)
        run.clock = run.stream.free  # the initial placement is loaded before the first token

    def set_caller_issues(self, run: RunState) -> None:
        gpu = run.prof.gpu
        self.caller_issues = run.on_gpu and gpu is not None and not load_worker_default(gpu.name)

    def begin_step(self, run: RunState, s: Step) -> None:
        self.pending = []

    def nodes(self, run: RunState, s: Step) -> int:
        return CACHE_NODES_PER_LAYER * len(run.shape.moe_layers)

    def route(self, run: RunState, lay: MoeLayer, acc: Acc) -> dict[int, int]:
        loads = self.policy.on_route(lay.il, lay.ids)
        if self.policy.blocking and loads:
            acc.pcie += run.stream.queue(loads, start=lay.t)
        elif loads:
            self.pending += loads
        resident = run.stream.resident.get(lay.il, {})
        gpu_e = {e: c for e, c in lay.counts.items() if e in resident}
        hits = sum(gpu_e.values())
        acc.hits += hits
        acc.misses += sum(lay.counts.values()) - hits
        return gpu_e

    def end_step(self, run: RunState, t: float, acc: Acc) -> float:
        if self.pending:
            acc.pcie += run.stream.queue(self.pending, start=t)
            if self.caller_issues:
                acc.host += run.stream.free - t
                t = run.stream.free
        return t
