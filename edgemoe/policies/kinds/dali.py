"""The dali policy: DALI's workload-aware replacement (residency.DaliPolicy), optionally with its residual
prefetcher (dali_prefetch.DaliPrefetchPolicy, in the routing hook)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ...errors import EdgeMoeError, InvalidConfigError
from ..allocation import dali_all_sizes
from ..dali_prefetch import (
    DALI_PREFETCH_DISTANCE,
    DALI_PREFETCH_REFUSAL,
    DaliPrefetchPolicy,
    dali_prefetch_refusal,
)
from ..registry import (
    LayerReplay,
    NativeStep,
    PolicyInputs,
    PolicySpec,
    PrefetchInputs,
    RequestOption,
    register,
)
from ..residency import DALI_WINDOW, DaliPolicy, dali_default_update
from .copy_queue_options import CopyQueueOptions
from .lru import refuse_assign


@dataclass(frozen=True)
class DaliConfig(CopyQueueOptions):
    """DALI's workload-aware replacement (residency.DaliPolicy), optionally with its residual prefetcher."""

    name: ClassVar[str] = "dali"
    window: int = DALI_WINDOW  # tokens per window (w)
    update: int | None = None  # experts replaced per window (u); None: the paper's for the model
    # experts of the next MoE layer its residual predictor prefetches per layer (DALI's prefetch size,
    # edgemoe.policies.dali_prefetch); 0: replacement only, which runs natively
    prefetch: int = 0
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step
    assign: str | None = None  # as LruConfig.assign (not with the prefetcher)
    assign_costs: Mapping[int, Any] | None = None
    calibration: Path | None = None  # the prefetcher's residual predictor (gate reuse without one)

    def assignment(self) -> tuple[str, Mapping[int, Any] | None] | None:
        return None if self.assign is None else (self.assign, self.assign_costs)

    def __post_init__(self) -> None:
        if self.prefetch:
            refusal = dali_prefetch_refusal(blocking=self.blocking)
            if refusal is not None:
                raise InvalidConfigError(refusal)
        refuse_assign(self.assign, blocking=self.blocking, prefetcher=self.prefetch > 0)

    @property
    def prefetcher(self) -> bool:
        return self.prefetch > 0

    def request_refusal(self) -> str | None:
        for option, value in (("`dali_window`", self.window), ("`dali_update`", self.update)):
            if value is not None and value < 1:
                return f"{option} {value}: at least 1"
        return None

    def hook_option(self) -> str | None:
        return "`dali_prefetch`" if self.prefetch else None

    def prefetch_predictor(self) -> tuple[str, int, Path | None] | None:
        return ("residual", DALI_PREFETCH_DISTANCE, self.calibration) if self.prefetch else None

    def extra_calibration(self) -> tuple[str, tuple[str, ...]] | None:
        return ("`dali_prefetch`", ("predictors",)) if self.prefetch else None

    def allocation_options(self) -> dict[str, Any]:
        return {"dali_window": self.window, "dali_update": self.update}

    def replay_key(self, n_expert: int) -> dict[str, Any]:
        return {"window": self.window, "update": self.resolved_update(n_expert)}

    def resolved_update(self, n_expert: int) -> int:
        """u for a model of n_expert experts: the record's, else the paper's."""
        return dali_default_update(n_expert) if self.update is None else self.update


def _build(config: DaliConfig, inputs: PolicyInputs) -> DaliPolicy:
    if inputs.n_expert is None:
        raise EdgeMoeError("the dali policy needs the model's expert count (n_expert)")
    n = inputs.n_expert
    return DaliPolicy(
        dict(inputs.slots),
        n,
        window=config.window,
        blocking=config.blocking,
        update=config.resolved_update(n),
    )


def _all_sizes(config: DaliConfig, r: LayerReplay) -> tuple[np.ndarray, np.ndarray]:
    DaliPolicy(
        {}, r.n_expert, window=config.window, update=1 if config.update is None else config.update
    )  # checks
    update = config.resolved_update(r.n_expert)
    return dali_all_sizes(r.steps, r.flags, r.max_slots, r.n_expert, config.window, update)


def _native(config: DaliConfig, policy: DaliPolicy) -> NativeStep | None:
    if config.blocking:
        return None  # blocking loads need the routing hook
    what = f"dali window {policy.window} / update {policy.update}"
    return NativeStep("window_replacement", (policy.window, policy.update), what)


def _prefetch(config: DaliConfig, inputs: PrefetchInputs) -> DaliPrefetchPolicy:
    return DaliPrefetchPolicy(
        inputs.slots,
        inputs.layers,
        inputs.predictor,
        inputs.n_expert,
        size=config.prefetch,
        window=config.window,
        update=config.resolved_update(inputs.n_expert),
        timing=config.admitted_timing,
    )


SPEC = register(
    PolicySpec(
        name="dali",
        config=DaliConfig,
        help="DALI's workload-aware replacement: every `dali_window` tokens the most-used absent experts "
        "replace the least-used resident ones; with `dali_prefetch` also DALI's prefetcher, in the routing hook",
        build=_build,
        options=(
            RequestOption(
                "dali_window", "window", "`dali_window` and `dali_update` are options of `policy='dali'`"
            ),
            RequestOption(
                "dali_update", "update", "`dali_window` and `dali_update` are options of `policy='dali'`"
            ),
            RequestOption("dali_prefetch", "prefetch", DALI_PREFETCH_REFUSAL, unset=(None, 0)),
        ),
        all_sizes=_all_sizes,
        native=_native,
        prefetch=_prefetch,
    )
)
