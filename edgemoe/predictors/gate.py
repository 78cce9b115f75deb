"""Router reuse: layer l+d's own router on layer l's gate input (AdapMoE §4.3, DAOP §III-3), and
DALI's residual-corrected version (§4.2, eq. 10-11): h~_l = h_l + res_vec_l, res_vec_l the mean of
h_{l+d} - h_l over the calibration tokens.

Both score with router logits; the fixtures' routers are softmax-then-top-k, so the logit
ranking is the probability ranking.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Known, ModelSpec, Predictor, PredictorError, PredictorKind
from .registry import register


@register(PredictorKind.GATE)
class GatePredictor(Predictor):
    """No calibration data: only the model's routers."""

    def scores(self, known: Known) -> np.ndarray:
        return known.hidden @ self.spec.router(known.target).T


@register(PredictorKind.RESIDUAL)
class ResidualPredictor(Predictor):
    trained = True

    def __init__(self, spec: ModelSpec, distance: int, res_vec: np.ndarray | None = None) -> None:
        super().__init__(spec, distance)
        if res_vec is None or res_vec.shape != (spec.n_layers, spec.n_embd):
            raise PredictorError(
                f"residual predictor: res_vec must be ({spec.n_layers}, {spec.n_embd}); "
                "run `edgemoe calibrate` again for this model"
            )
        self.res_vec = res_vec.astype(np.float32)  # (L, n_embd): row `target`, zeros where not covered

    @classmethod
    def fit(cls, spec: ModelSpec, distance: int, gate_inputs: np.ndarray) -> ResidualPredictor:
        """gate_inputs (T, L, n_embd) of the calibration tokens -> res_vec (eq. 11, for distance d)."""
        res = np.zeros((spec.n_layers, spec.n_embd), np.float32)
        for t in range(distance, spec.n_layers):
            diff = gate_inputs[:, t].astype(np.float32) - gate_inputs[:, t - distance].astype(np.float32)
            res[t] = diff.mean(0)
        return cls(spec, distance, res)

    def scores(self, known: Known) -> np.ndarray:
        return (known.hidden + self.res_vec[known.target]) @ self.spec.router(known.target).T

    def arrays(self) -> dict[str, np.ndarray]:
        return {"res_vec": self.res_vec}

    def n_params(self) -> int:
        return self.spec.n_embd  # one vector per covered layer

    @classmethod
    def from_arrays(
        cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]
    ) -> ResidualPredictor:
        return cls(spec, distance, arrays.get("res_vec"))
