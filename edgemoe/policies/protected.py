"""Experts that no rule may drop or swap: a model's "super experts" (pure numpy).

Su et al., "Unveiling Super Experts in Mixture-of-Experts Large Language Models" (2025), find a few experts
whose down-projection output carries activation outliers orders of magnitude above every other expert's, at a
few layers; skipping just three of them breaks Qwen3-30B-A3B. Calibration finds them
(edgemoe.calibration.super_experts) and adaptive top-k (edgemoe.policies.gating) and graceful degradation
(edgemoe.policies.degrade) keep every slot that routes to one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ProtectedExperts:
    """A set of (layer, expert) pairs; empty: nothing protected."""

    pairs: frozenset[tuple[int, int]] = frozenset()
    _by_layer: dict[int, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by: dict[int, list[int]] = {}
        for il, e in self.pairs:
            by.setdefault(int(il), []).append(int(e))
        object.__setattr__(self, "_by_layer", {il: np.array(sorted(es), np.int64) for il, es in by.items()})

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> ProtectedExperts:
        return cls(frozenset((int(il), int(e)) for il, e in pairs))

    def __bool__(self) -> bool:
        return bool(self.pairs)

    @property
    def layers(self) -> list[int]:
        return sorted(self._by_layer)

    def experts(self, layer: int) -> np.ndarray:
        """The protected expert ids of `layer` (sorted; empty where none)."""
        return self._by_layer.get(layer, np.zeros(0, np.int64))

    def mask(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Bool array shaped like ids: the slots of `layer` routed to a protected expert (-1 never is)."""
        prot = self._by_layer.get(layer)
        if prot is None:
            return np.zeros(np.shape(ids), bool)
        return np.isin(ids, prot)

    def to_list(self) -> list[list[int]]:
        return [[il, e] for il, e in sorted(self.pairs)]
