"""The predictor registry: PredictorKind -> class, filled by the @register decorator of each kind.

The kind modules import this module (never the reverse); edgemoe.predictors imports every kind,
so the registry is complete as soon as anything in the package is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from .base import ModelSpec, Predictor, PredictorError, PredictorKind, parse_kind

P = TypeVar("P", bound=Predictor)
_REGISTRY: dict[PredictorKind, type[Predictor]] = {}


def register(kind: PredictorKind) -> Callable[[type[P]], type[P]]:
    """Class decorator: make `kind` build this class."""

    def deco(cls: type[P]) -> type[P]:
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return deco


def predictor_class(kind: str | PredictorKind) -> type[Predictor]:
    k = parse_kind(kind)
    return _REGISTRY[k]


def create_predictor(
    kind: str | PredictorKind, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray] | None = None
) -> Predictor:
    """The factory: a predictor of `kind` for `distance`, from its stored arrays when it is trained."""
    cls = predictor_class(kind)
    if cls.trained and not arrays:
        raise PredictorError(
            f"the {cls.kind.value} predictor needs calibration data: run `edgemoe calibrate`"
        )
    return cls.from_arrays(spec, distance, arrays or {})
