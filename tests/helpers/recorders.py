"""Route policies that record what the engine routed, grouped per ubatch, for replays of the pure policies."""
from __future__ import annotations

import numpy as np


class StepRecorder:
    """A route policy that groups each ubatch's routes into a step: [(layer, ids copy), ...] in layer order,
    as edgemoe.policies.residency.simulate replays them."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, np.ndarray]]] = []

    def on_route(self, r) -> None:  # type: ignore[no-untyped-def]
        if not self.steps or r.layer <= self.steps[-1][-1][0]:
            self.steps.append([])
        self.steps[-1].append((r.layer, r.ids.copy()))


class RouteRecorder:
    """Each ubatch's routes as replay() takes them: [(layer, ids, router input), ...] in layer order."""

    wants_probs = False
    wants_gate_inp = True

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, np.ndarray, np.ndarray]]] = []

    def on_route(self, r) -> None:  # type: ignore[no-untyped-def]
        if not self.steps or r.layer <= self.steps[-1][-1][0]:
            self.steps.append([])
        assert r.gate_inp is not None
        self.steps[-1].append((r.layer, r.ids.copy(), r.gate_inp.copy()))
