"""The expert cache right after a prompt prefilled in borrowed slots (--device-prefill-borrow): the layers that
lent their slots to the two prefill buffers get them back empty, and their placement's loads go on the copy
stream as the run starts (the runtime refills them with the prompt's most routed experts); until a refilled
expert's load lands it runs on the CPU as any miss. The other layers' placement is resident from the start."""

from __future__ import annotations

from ....policies.residency import ResidencyPolicy
from .cache import ExpertCache
from .feature import Acc, MoeLayer
from .state import RunState


class RefillingCache(ExpertCache):
    def __init__(self, policy: ResidencyPolicy, lent: frozenset[int]) -> None:
        super().__init__(policy)
        self.lent = lent

    def start(self, run: RunState) -> None:
        self.set_caller_issues(run)
        loads = self.policy.initial_loads()
        run.stream.place([ld for ld in loads if ld.layer not in self.lent])  # resident before the prompt
        run.stream.queue([ld for ld in loads if ld.layer in self.lent], start=0.0)
        run.clock = 0.0

    def route(self, run: RunState, lay: MoeLayer, acc: Acc) -> dict[int, int]:
        gpu_e = super().route(run, lay, acc)
        if lay.il not in self.lent:
            return gpu_e
        ready = run.stream.ready
        landed = {e: c for e, c in gpu_e.items() if ready.get((lay.il, e), 0.0) <= lay.t}
        moved = sum(gpu_e.values()) - sum(landed.values())
        acc.hits -= moved
        acc.misses += moved
        return landed
