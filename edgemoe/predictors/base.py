"""The expert-predictor interface: what is known at MoE layer l of token t -> scores of layer l+d's experts.

Predictions are indexed by the *target* MoE layer (position 0..L-1 in the model's
MoE layers) and the prediction distance d (1 = next layer, 2 = ProMoE's stride
prefetch). The source of a prediction is the router input of MoE layer target-d
of the same token; for target < d it wraps to layer L+target-d of the previous
token (AdapMoE's first-layer predictive gate), because in decode the previous
token's last layers run right before the current token's first ones.

A predictor is a small numpy object; `scores(known)` returns one row of expert
scores per token (higher = more likely selected; only the ranking matters).
Learned predictors are trained by edgemoe.predictors.train (torch) and stored as
numpy arrays, so run-time inference needs numpy only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import EdgeMoeError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


class PredictorError(EdgeMoeError):
    """A predictor kind is unknown, or its stored artifact is missing or does not fit the model."""


class PredictorKind(str, Enum):
    MLP = "mlp"  # ProMoE: a two-layer MLP per (layer, distance) on the gate input of layer l
    GATE = "gate"  # AdapMoE / DAOP: layer l+d's router applied to layer l's gate input
    RESIDUAL = "residual"  # DALI eq. 10-11: layer l+d's router on h_l + mean(h_{l+d} - h_l)
    PREV_TOKEN = "prev-token"  # the experts layer l+d used for the previous token
    TOKEN_ID = "token-id"  # the experts layer l+d used most for this input token id (calibration)
    FIRST_LAYER = "first-layer"  # AdapMoE eq. 9: a linear gate for layer target < d from the previous token
    RANDOM = "random"  # chance level: uniform random scores (the floor every kind must beat)


def parse_kind(name: str | PredictorKind) -> PredictorKind:
    """'mlp' -> PredictorKind.MLP; unknown names fail with the list of valid ones."""
    if isinstance(name, PredictorKind):
        return name
    try:
        return PredictorKind(name)
    except ValueError:
        valid = ", ".join(k.value for k in PredictorKind)
        raise PredictorError(f"unknown predictor kind {name!r}: use one of {valid}") from None


def source_of(target: int, distance: int, n_layers: int) -> tuple[int, int]:
    """(token offset, MoE layer) whose router input a prediction of `target` at `distance` starts from.

    Offset 0 is the current token, -1 the previous one (when target < distance).
    """
    if distance < 1 or not 0 <= target < n_layers:
        raise PredictorError(
            f"no source for target layer {target} at distance {distance} in a model of {n_layers} MoE layers"
        )
    src = target - distance
    return (0, src) if src >= 0 else (-1, n_layers + src)


@dataclass(frozen=True)
class ModelSpec:
    """What predictors need to know about the model; routers indexed by MoE layer position (not il)."""

    layers: tuple[int, ...]  # model layer index (il) of each MoE layer
    n_expert: int
    k: int  # experts used per token (top-k)
    n_embd: int
    routers: Mapping[int, np.ndarray] | None = None  # position -> (n_expert, n_embd) float32 router weight

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def router(self, target: int) -> np.ndarray:
        if self.routers is None or target not in self.routers:
            raise PredictorError(
                f"the router of MoE layer {target} is not loaded: build the ModelSpec with "
                "routers=load_routers(model, layers) (edgemoe.gguf.routers)"
            )
        return self.routers[target]


@dataclass(frozen=True)
class Known:
    """What the runtime knows when it predicts MoE layer `target` of N tokens, `distance` layers ahead."""

    target: int  # MoE layer position to score
    distance: int
    hidden: np.ndarray  # (N, n_embd) float32 router input at source_of(target, distance)
    tokens: np.ndarray  # (N,) int32 input token ids (known from the start of the token's forward pass)
    prev_ids: np.ndarray  # (N, k) int32 experts layer `target` used for the previous token; -1 = none

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


class Predictor(ABC):
    """Scores the experts of one target MoE layer from what is known `distance` layers before it.

    Contract: `covers(target)` says which target layers the predictor handles;
    `scores(known)` returns (N, n_expert) float32 for a covered target. Only the
    ranking matters: the top-k of a row is the predicted set. `arrays()` and
    `from_arrays()` are the artifact round trip (plain numpy, no pickle).
    """

    kind: ClassVar[PredictorKind]
    distance_free: ClassVar[bool] = False  # predicts from the start of the token: the same at every d
    trained: ClassVar[bool] = False  # needs calibration data (an artifact) to exist

    def __init__(self, spec: ModelSpec, distance: int) -> None:
        self.spec = spec
        self.distance = distance

    def covers(self, target: int) -> bool:
        """Within-token kinds cover targets >= d; override for the others."""
        return self.distance <= target < self.spec.n_layers

    @abstractmethod
    def scores(self, known: Known) -> np.ndarray: ...

    def arrays(self) -> dict[str, np.ndarray]:
        """The artifact's arrays (empty for predictors without calibration data)."""
        return {}

    @classmethod
    def from_arrays(cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]) -> Self:
        return cls(spec, distance)

    def n_params(self) -> int:
        """Stored parameters per covered target layer."""
        n = sum(int(a.size) for a in self.arrays().values())
        covered = sum(self.covers(t) for t in range(self.spec.n_layers))
        return n // max(covered, 1)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "distance": self.distance,
            "targets": [t for t in range(self.spec.n_layers) if self.covers(t)],
        }


def topk_ids(scores: np.ndarray, n: int) -> np.ndarray:
    """(N, E) scores -> (N, n) expert ids, best first (stable: ties go to the lower id)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :n]
