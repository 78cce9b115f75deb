"""The daop policy: DAOP's data-aware placement, static plus a swap per prompt (daop.DaopPolicy)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ...errors import EdgeMoeError
from ..daop import DAOP_SWAP_THRESHOLD, DaopPolicy, replay_all_sizes
from ..registry import LayerReplay, NativeStep, PolicyInputs, PolicyRecord, PolicySpec, register
from .static import FREQUENCY_STAGES, needs_calibration, placement_frequency


@dataclass(frozen=True)
class DaopConfig(PolicyRecord):
    """DAOP's data-aware placement (policies.daop.DaopPolicy): static plus a swap per prompt."""

    name: ClassVar[str] = "daop"
    calibration: Path | None = None  # where the decode-phase router frequencies are
    threshold: float = DAOP_SWAP_THRESHOLD  # SwapInOut: a prompt's expert swaps in above this ratio
    blocking: bool = False  # swap before the layer runs instead of after the step


def _build(config: DaopConfig, inputs: PolicyInputs) -> DaopPolicy:
    if inputs.n_expert is None:
        if inputs.frequency is None and config.calibration is None:
            raise needs_calibration(config.name)
        raise EdgeMoeError("the daop policy needs the model's expert count (n_expert)")
    freq = placement_frequency(config.name, config.calibration, inputs, phase="decode")
    return DaopPolicy(
        freq, dict(inputs.slots), inputs.n_expert, threshold=config.threshold, blocking=config.blocking
    )


def _all_sizes(config: DaopConfig, r: LayerReplay) -> tuple[np.ndarray, np.ndarray]:
    assert r.frequency is not None
    return replay_all_sizes(
        r.steps, r.flags, r.max_slots, r.n_expert, r.frequency, threshold=config.threshold
    )


def _native(config: DaopConfig, policy: DaopPolicy) -> NativeStep | None:
    if config.blocking:
        return None  # blocking swaps need the routing hook
    return NativeStep("prompt_swap", (policy.threshold,), f"the daop threshold {policy.threshold}")


SPEC = register(
    PolicySpec(
        name="daop",
        config=DaopConfig,
        help="DAOP: the calibration's most used decode experts, swapped once per prompt by the prompt's routing",
        build=_build,
        stages=FREQUENCY_STAGES,
        frequency_phase="decode",
        all_sizes=_all_sizes,
        native=_native,
    )
)
