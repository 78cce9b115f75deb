"""Options shared by several command groups: adaptive top-k gating (--gating, --threshold, ...)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .types import Finite


def gating_options(f: Any) -> Any:
    opts = [
        click.option("--gating", type=click.Choice(["off", "fisher", "empirical", "score", "ser"]), default="off",
                     show_default=True, help="adaptive top-k: drop experts a token does not need (docs/gating.md)"),
        click.option("--threshold", type=Finite(0.0), default=None,
                     help="the gating rule's threshold (finite, >= 0)"),
        click.option("--target-reduction", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
                     default=None, help="find the threshold that drops this share of expert activations "
                                        "(on the calibration's validation text), e.g. 0.25"),
        click.option("--calibration", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="calibration directory (default: the model's, see docs/predictors.md)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def gating_from_options(model: Path, gating: str, threshold: float | None, target_reduction: float | None,
            calibration: Path | None, *, decode_only: bool) -> Any:
    from ..calibration.adaptive import GatingOptions

    if calibration is None:
        from ..calibration.adaptive import default_calibration_dir

        calibration = default_calibration_dir(model)
    return GatingOptions(mode=gating, threshold=threshold, target_reduction=target_reduction,
                         calibration=calibration, decode_only=decode_only)
