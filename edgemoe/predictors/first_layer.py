"""AdapMoE's predictive gate for the first MoE layer (§4.3, eq. 9): a linear gate G_pre on the
previous token's last-layer router input, trained so that softmax(G_pre(A_last)) matches the
first layer's routing softmax(G_first(A_first)) in KL divergence.

With distance d it covers the targets 0..d-1, each from the previous token's layer L+target-d
(d = 1: layer 0 from layer L-1, exactly the paper's gate). Parameters: n_embd x n_expert per
target, no bias, initialised from the target layer's own router.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Known, ModelSpec, Predictor, PredictorError, PredictorKind
from .registry import register


@register(PredictorKind.FIRST_LAYER)
class FirstLayerPredictor(Predictor):
    trained = True

    def __init__(self, spec: ModelSpec, distance: int, w: np.ndarray) -> None:
        super().__init__(spec, distance)
        want = (min(distance, spec.n_layers), spec.n_expert, spec.n_embd)
        if w.shape != want:
            raise PredictorError(
                f"first-layer gate is {w.shape}, expected {want}: calibrate again for this model"
            )
        self.w = w.astype(np.float32)  # (d, E, n_embd): row `target`

    def covers(self, target: int) -> bool:
        return 0 <= target < min(self.distance, self.spec.n_layers)

    def scores(self, known: Known) -> np.ndarray:
        return known.hidden @ self.w[known.target].T

    def arrays(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    @classmethod
    def from_arrays(
        cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]
    ) -> FirstLayerPredictor:
        if "w" not in arrays:
            raise PredictorError(f"first-layer d={distance} artifact lacks its weight: calibrate again")
        return cls(spec, distance, arrays["w"])
