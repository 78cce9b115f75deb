"""The manual policy: no loads of its own; the caller drives ExpertCache.load / prefetch (residency.ManualPolicy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..registry import NativeStep, PolicyInputs, PolicyRecord, PolicySpec, register
from ..residency import ManualPolicy


@dataclass(frozen=True)
class ManualConfig(PolicyRecord):
    """No loads of its own: the caller drives ExpertCache.load / prefetch."""

    name: ClassVar[str] = "manual"


def _build(config: ManualConfig, inputs: PolicyInputs) -> ManualPolicy:
    return ManualPolicy(dict(inputs.slots))


SPEC = register(
    PolicySpec(
        name="manual",
        config=ManualConfig,
        help="API only",
        build=_build,
        replayable=False,
        native=lambda config, policy: NativeStep("manual"),
    )
)
