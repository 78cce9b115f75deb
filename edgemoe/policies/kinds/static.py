"""The static policy: the calibration's most used experts of each layer, loaded once (residency.StaticPolicy)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ...errors import EdgeMoeError
from ..allocation import static_all_sizes
from ..registry import LayerReplay, NativeStep, PolicyInputs, PolicyRecord, PolicySpec, register
from ..residency import StaticPolicy, load_frequency

FREQUENCY_STAGES = ("router_frequency", "routing")  # what static and daop read (calibration.auto.STAGES_FOR)


@dataclass(frozen=True)
class StaticConfig(PolicyRecord):
    """The calibration's most used experts, loaded once (residency.StaticPolicy)."""

    name: ClassVar[str] = "static"
    calibration: Path | None = None  # where router_frequency.npz is


def needs_calibration(name: str) -> EdgeMoeError:
    """The error of a policy placed by router frequencies that was given no calibration."""
    return EdgeMoeError(
        f"the {name} policy needs a calibration with router frequencies: pass "
        "calibration=edgemoe.calibration.ensure_calibration(MODEL, STAGES_FOR['static'], ...) "
        "(made on first use), or run `edgemoe calibrate MODEL --corpus FILE`"
    )


def placement_frequency(
    name: str, calibration: Path | None, inputs: PolicyInputs, *, phase: str = "all"
) -> Mapping[int, np.ndarray]:
    """The router counts a policy placed by frequency places by: the inputs' own (replays, simulations), else
    its calibration's, of `phase` (residency.load_frequency)."""
    if inputs.frequency is not None:
        return inputs.frequency
    if calibration is None:
        raise needs_calibration(name)
    return load_frequency(calibration, n_expert=inputs.n_expert, layers=list(inputs.slots), phase=phase)


def _build(config: StaticConfig, inputs: PolicyInputs) -> StaticPolicy:
    return StaticPolicy(placement_frequency(config.name, config.calibration, inputs), dict(inputs.slots))


def _all_sizes(config: StaticConfig, r: LayerReplay) -> tuple[np.ndarray, np.ndarray]:
    assert r.frequency is not None
    return static_all_sizes(r.steps, r.flags, r.max_slots, r.n_expert, r.frequency)


SPEC = register(
    PolicySpec(
        name="static",
        compared=2,  # bench's and simulate's default comparison (lru, then static)
        config=StaticConfig,
        help="the calibration's most frequent",
        build=_build,
        stages=FREQUENCY_STAGES,
        frequency_phase="all",
        all_sizes=_all_sizes,
        native=lambda config, policy: NativeStep("manual"),  # its tables never change after the start
    )
)
