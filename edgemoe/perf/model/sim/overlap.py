"""The CPU/GPU overlap edgemoe's build runs by default with the cache on a device: a layer's CPU experts
start once its dense part (attention, router) is done and run while the GPU computes its experts (stock
llama.cpp runs the two branches one after the other)."""

from __future__ import annotations

from ..workload import Step
from .feature import Feature
from .state import RunState


class Overlap(Feature):
    def overlaps(self, run: RunState, s: Step) -> bool:
        return True
