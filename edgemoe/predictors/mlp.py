"""ProMoE's learned predictor (§4.3, §6.3): a two-layer MLP per (target layer, distance d) that maps
the router input of MoE layer l to expert scores of layer l+d (d = 2: stride prefetch, §4.4).

scores = W2 relu(W1 h + b1) + b2 + R_{l+d} h

The last term is layer l+d's router applied to h (gate reuse), frozen: the MLP learns a
correction on top of it, which keeps it close to gate reuse on text unlike its calibration
data. The input standardisation of training is folded into W1/b1. Weights are stored as
float16 (the artifact) and run in float32 numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Known, ModelSpec, Predictor, PredictorError, PredictorKind
from .registry import register

# at most 128 wide: wider ones cost more than 3% of a decode step on the CPU (the full-depth synthetic
# Qwen3-30B-A3B, docs/predictors.md: hidden 256 ~4%, 1024 6.6-8%; 128 ~2%)
MAX_HIDDEN = 128
MIN_HIDDEN = 64


def mlp_hidden(n_embd: int) -> int:
    """Hidden width n_embd / 2 in [64, 128]: 128 for the 256-wide fixtures and above (Qwen3-30B-A3B: 2048 x 128
    + 128 x 128 trained parameters per layer beside the frozen router, where ProMoE's MLP has ~2M)."""
    return int(min(MAX_HIDDEN, max(MIN_HIDDEN, n_embd // 2)))


_NAMES = ("w1", "b1", "w2", "b2", "skip")


@register(PredictorKind.MLP)
class MLPPredictor(Predictor):
    trained = True

    def __init__(
        self,
        spec: ModelSpec,
        distance: int,
        w1: np.ndarray,
        b1: np.ndarray,
        w2: np.ndarray,
        b2: np.ndarray,
        skip: np.ndarray,
    ) -> None:
        super().__init__(spec, distance)
        P = spec.n_layers - distance
        want = {
            "w1": (P, spec.n_embd, None),
            "b1": (P, None),
            "w2": (P, None, spec.n_expert),
            "b2": (P, spec.n_expert),
            "skip": (P, spec.n_embd, spec.n_expert),
        }
        got = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "skip": skip}
        for name, shape in want.items():
            a = got[name]
            if a.ndim != len(shape) or any(
                s is not None and s != n for s, n in zip(shape, a.shape, strict=False)
            ):
                raise PredictorError(
                    f"mlp d={distance}: {name} is {a.shape}, expected {shape} for this model "
                    "(None = any): calibrate again for this model"
                )
        self._stored = {n: a for n, a in got.items()}  # as stored (float16 weights)
        # (P, ...) float32 copies for inference; index p = target - distance
        self.w1, self.b1, self.w2, self.b2, self.skip = (got[n].astype(np.float32) for n in _NAMES)

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[2])

    def scores(self, known: Known) -> np.ndarray:
        p = known.target - self.distance
        h = known.hidden
        z = np.maximum(h @ self.w1[p] + self.b1[p], 0.0)
        return z @ self.w2[p] + self.b2[p] + h @ self.skip[p]

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(self._stored)

    def n_params(self) -> int:
        """Trained parameters per layer (the frozen router copy `skip` not counted)."""
        return int(self.w1[0].size + self.b1[0].size + self.w2[0].size + self.b2[0].size)

    @classmethod
    def from_arrays(cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]) -> MLPPredictor:
        missing = [n for n in _NAMES if n not in arrays]
        if missing:
            raise PredictorError(f"mlp d={distance} artifact lacks {missing}: calibrate again")
        return cls(spec, distance, *(arrays[n] for n in _NAMES))
