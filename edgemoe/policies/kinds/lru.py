"""The lru policy: per-layer least recently used (residency.LruPolicy), optionally under a CPU/GPU assigner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...errors import InvalidConfigError
from ..allocation import lru_all_sizes
from ..assignment import assign_refusal
from ..registry import LayerReplay, NativeStep, PolicyInputs, PolicyRecord, PolicySpec, register
from ..residency import LruPolicy


def refuse_assign(assign: str | None, *, blocking: bool, prefetcher: bool) -> None:
    """The records that take an assigner refuse it where it cannot act (assignment.assign_refusal)."""
    if assign is not None:
        refusal = assign_refusal(blocking=blocking, prefetcher=prefetcher)
        if refusal is not None:
            raise InvalidConfigError(refusal)


@dataclass(frozen=True)
class LruConfig(PolicyRecord):
    """Per-layer least-recently-used (residency.LruPolicy)."""

    name: ClassVar[str] = "lru"
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step
    # per route, a CPU/GPU assigner (edgemoe.policies.assignment: "ratio", "greedy") decides which of the
    # policy's loads to make before the layer runs (computed on the GPU this step) rather than for its next run
    # (the miss on the CPU); needs assign_costs (edgemoe.perf.model.costmodel.expert_costs from a profile). Runs in
    # the routing hook: a host sync per MoE layer
    assign: str | None = None
    assign_costs: Mapping[int, Any] | None = None  # MoE layer -> edgemoe.policies.assignment.ExpertCosts

    def assignment(self) -> tuple[str, Mapping[int, Any] | None] | None:
        return None if self.assign is None else (self.assign, self.assign_costs)

    def __post_init__(self) -> None:
        refuse_assign(self.assign, blocking=self.blocking, prefetcher=False)


def _build(config: LruConfig, inputs: PolicyInputs) -> LruPolicy:
    return LruPolicy(dict(inputs.slots), blocking=config.blocking)


def _all_sizes(config: LruConfig, r: LayerReplay) -> tuple[np.ndarray, np.ndarray]:
    return lru_all_sizes(r.steps, r.flags, r.max_slots, r.n_expert)


def _native(config: LruConfig, policy: LruPolicy) -> NativeStep | None:
    return None if config.blocking else NativeStep("lru")  # blocking loads need the routing hook


SPEC = register(
    PolicySpec(
        name="lru",
        compared=1,  # bench's and simulate's default comparison (lru, then static)
        config=LruConfig,
        help="load misses for the next token",
        build=_build,
        all_sizes=_all_sizes,
        native=_native,
    )
)
