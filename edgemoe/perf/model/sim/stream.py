"""The copy stream of a simulated run: the expert cache's loads go over the link one after the other, at
the loader's bandwidth (`LinkProfile.loads_bw`, or `h2d_pageable` for another engine's pageable copies),
and it keeps which expert each slot holds and when each load completes."""

from __future__ import annotations

from typing import Any

from ..costmodel import ModelShape
from ..profile import LinkProfile


class CopyStream:
    def __init__(self, shape: ModelShape, link: LinkProfile | None, *, timed: bool, pageable: bool) -> None:
        self.shape = shape
        self.link = (
            link if timed else None
        )  # None: the loads take no time (no GPU, or no link in the profile)
        self.pageable = pageable
        self.free = 0.0  # when the stream finishes its last queued copy
        self.ready: dict[tuple[int, int], float] = {}  # (layer, expert) -> when its load completes
        self.resident: dict[int, dict[int, int]] = {}  # layer -> expert -> slot

    def queue(self, loads: list[Any], start: float) -> int:
        """Copy `loads` (policy loads: layer, expert, slot) from `start` or when the stream is free, in
        order; returns the bytes copied."""
        t = max(self.free, start)
        nbytes = 0
        for ld in loads:
            self._hold(ld)
            b = self.shape.expert_bytes(ld.layer)
            nbytes += b
            if self.link is not None:
                # the cache's loader: chunks from its staging buffers (another engine's: maybe pageable)
                t += b / (self.link.h2d_pageable if self.pageable else self.link.loads_bw)
            self.ready[(ld.layer, ld.expert)] = t
        self.free = t
        return nbytes

    def place(self, loads: list[Any]) -> None:
        """Hold `loads` as resident already (placed before the run: nothing to copy, ready from the start)."""
        for ld in loads:
            self._hold(ld)
            self.ready[(ld.layer, ld.expert)] = 0.0

    def _hold(self, ld: Any) -> None:
        """Slot ld.slot of layer ld.layer holds ld.expert (whatever held that slot, or that expert, no longer)."""
        slots = self.resident.setdefault(ld.layer, {})
        for e in [e for e, s in slots.items() if s == ld.slot or e == ld.expert]:
            del slots[e]
        slots[ld.expert] = ld.slot
