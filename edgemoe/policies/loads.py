"""What a residency policy answers with (a Load: copy expert e of layer l into slot s), and the experts a
ubatch uses. A module of its own so that every residency policy module can import it without a circle
(residency.make_policy builds them all)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Load:
    layer: int
    expert: int
    slot: int


@runtime_checkable
class Reseedable(Protocol):
    """A policy that can go on from what is resident (the engine hands it back from llama.cpp's native step)."""

    def reseed(self, slots: Mapping[int, Sequence[int]]) -> None:
        """layer -> slot of each expert (-1: absent)."""
        ...


class Residency(Protocol):
    """What every residency policy is to the rest of edgemoe (its spec's `build` makes one): the loads it starts
    with, and its answer to each MoE layer's routed ids."""

    @property
    def n_slots(self) -> Mapping[int, int]:
        """layer -> slots."""
        ...

    blocking: bool  # a miss is loaded before its layer runs (else for the layer's next run)

    def initial_loads(self) -> list[Load]: ...

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]: ...


def used_experts(ids: np.ndarray) -> list[int]:
    """Experts a ubatch's (n_tokens, k) ids use, in first-use order (dropped slots, -1, left out)."""
    flat = np.asarray(ids).reshape(-1)
    _, first = np.unique(flat, return_index=True)
    return [int(flat[i]) for i in sorted(first) if flat[i] >= 0]


def split_loads(policy: Any, loads: list[Load]) -> tuple[list[Load], list[Load]]:
    """(loads made before the routed layer runs, loads used from its next run) of a policy's answer to a route:
    all of them for a blocking policy, else those of the experts in its `load_now` (AssignedPolicy), if any."""
    if policy.blocking:
        return loads, []
    now = getattr(policy, "load_now", None)
    if not now:
        return [], loads
    return [ld for ld in loads if ld.expert in now], [ld for ld in loads if ld.expert not in now]
