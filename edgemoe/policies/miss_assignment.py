"""Per-route CPU/GPU assignment of a residency policy's misses (DALI §4.1).

A residency policy (lru, dali) decides which experts a layer's slots hold and, for a miss, loads it
for the layer's next run while this step computes it on the CPU. `AssignedPolicy` asks, at every
route (a prefill ubatch or a decode token), a CPU/GPU assigner (edgemoe.policies.assignment) whether
some of those loads are worth making now instead: copied before the layer's experts run, so they
compute on the GPU this step. The assigner minimises the layer's makespan max(T_cpu, T_gpu + copies)
from a per-layer cost model (a machine profile's: edgemoe.perf.model.costmodel.expert_costs), so a decode
miss waits for its copy only when that beats the CPU, and a prefill ubatch loads the experts with
many tokens when the CPU side is the longer one.

What the runtime can honour: an expert resident in the layer's slots runs on the GPU whatever the
assigner says (nothing moves a resident expert to the CPU), and only experts the residency policy
loads at this route can be loaded now (the slots it frees are the only room; DALI's memory bound).
Everything else is the inner policy's: its residency, its loads, its counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .assignment import Assigner, ExpertCosts, workload_from_ids
from .loads import Load


@dataclass
class AssignedPolicy:
    """`inner`'s residency; each route's loads the assigner puts on the GPU are made before the layer runs."""

    inner: Any  # a non-blocking residency policy with resident(layer): LruPolicy, DaliPolicy
    costs: Mapping[int, ExpertCosts]  # MoE layer -> its cost model (a layer without one: no loads now)
    assigner: Assigner
    name: str = "ratio"  # the assigner's name, for reports
    blocking: bool = False  # the loads not made now are the inner policy's, used from the layer's next run
    load_now: set[int] = field(
        default_factory=set
    )  # experts of the last route's layer to load before it runs
    routes: int = 0  # routes with at least one miss the inner policy loads
    loaded_now: int = 0  # loads made before their layer ran
    deferred: int = 0  # loads left for the layer's next run (the miss computed on the CPU)

    @property
    def n_slots(self) -> Mapping[int, int]:
        return self.inner.n_slots

    def initial_loads(self) -> list[Load]:
        return self.inner.initial_loads()

    def resident(self, layer: int) -> set[int]:
        return self.inner.resident(layer)

    def reseed(self, slots: Mapping[int, Any]) -> None:
        self.inner.reseed(slots)

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        resident = self.inner.resident(layer)  # what the layer runs with
        loads = self.inner.on_route(layer, ids)
        self.load_now = set()
        cost = self.costs.get(layer)
        if not loads or cost is None:
            return loads
        a = self.assigner(workload_from_ids(np.asarray(ids)), resident, cost)
        self.load_now = set(a.load) & {ld.expert for ld in loads}
        self.routes += 1
        self.loaded_now += len(self.load_now)
        self.deferred += len(loads) - len(self.load_now)
        return loads

    def report(self) -> dict[str, Any]:
        return {
            "assigner": self.name,
            "routes": self.routes,
            "loaded_now": self.loaded_now,
            "deferred": self.deferred,
        }
