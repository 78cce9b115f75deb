"""Another engine's cache that reads each cached layer's routing on the host before the layer's experts run
(the backtest's): one device-to-host synchronisation, the link's latency, per cached layer."""

from __future__ import annotations

from collections.abc import Mapping

from .feature import Acc, Feature
from .state import RunState


class HostRouted(Feature):
    def __init__(self, slots: Mapping[int, int]) -> None:
        self.slots = slots

    def layer_wait(self, run: RunState, il: int, wait: float, acc: Acc) -> float:
        if il in self.slots and run.prof.link is not None:
            wait += run.prof.link.latency_s  # the routing read back before the layer's experts
            acc.host += run.prof.link.latency_s
        return wait
