"""Baselines that need no gate input: the previous token's experts (temporal locality), the experts
an input token id used most in the calibration trace (ProMoE's token-based predictor, §4.2), and
uniform random scores (chance level).

All three predict from the start of a token's forward pass, so they score the same at every
distance. Ties are broken by the calibration router frequency when it is known.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Known, ModelSpec, Predictor, PredictorError, PredictorKind
from .registry import register


def _frequency(spec: ModelSpec, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    f = arrays.get("frequency")
    if f is None:
        return np.zeros((spec.n_layers, spec.n_expert), np.float32)
    if f.shape != (spec.n_layers, spec.n_expert):
        raise PredictorError(
            f"frequency table is {f.shape}, the model has ({spec.n_layers}, {spec.n_expert}) "
            "MoE layers x experts: calibrate again for this model"
        )
    return f.astype(np.float32)


@register(PredictorKind.PREV_TOKEN)
class PrevTokenPredictor(Predictor):
    """The previous token's experts of the target layer first (router order), then the most frequent."""

    distance_free = True

    def __init__(self, spec: ModelSpec, distance: int, frequency: np.ndarray | None = None) -> None:
        super().__init__(spec, distance)
        self.frequency = _frequency(spec, {} if frequency is None else {"frequency": frequency})

    def covers(self, target: int) -> bool:
        return 0 <= target < self.spec.n_layers

    def scores(self, known: Known) -> np.ndarray:
        out = np.repeat(self.frequency[known.target][None, :], known.n, axis=0)  # shares < 1
        k = known.prev_ids.shape[1]
        rows = np.arange(known.n)
        for r in range(k):  # rank 0 (the router's first choice) scores highest
            ids = known.prev_ids[:, r]
            ok = ids >= 0
            out[rows[ok], ids[ok]] = 2.0 + (k - r) / k
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {"frequency": self.frequency}

    def n_params(self) -> int:
        return 0

    @classmethod
    def from_arrays(
        cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]
    ) -> PrevTokenPredictor:
        return cls(spec, distance, arrays.get("frequency"))


@register(PredictorKind.TOKEN_ID)
class TokenIdPredictor(Predictor):
    """Per seen token id and layer, the `ranked` most used experts; unseen ids get the frequency order."""

    distance_free = True
    trained = True

    def __init__(
        self, spec: ModelSpec, distance: int, vocab: np.ndarray, top: np.ndarray, frequency: np.ndarray
    ) -> None:
        super().__init__(spec, distance)
        if top.ndim != 3 or top.shape[:2] != (vocab.shape[0], spec.n_layers):
            raise PredictorError(
                f"token-id table {top.shape} does not fit {vocab.shape[0]} ids x "
                f"{spec.n_layers} layers: calibrate again for this model"
            )
        self.vocab = vocab.astype(np.int32)  # (U,) sorted token ids seen in calibration
        self.top = top.astype(np.int16)  # (U, L, R) most used experts, best first; -1 pads
        self.frequency = frequency.astype(np.float32)  # (L, E)

    @classmethod
    def fit(
        cls, spec: ModelSpec, distance: int, tokens: np.ndarray, ids: np.ndarray, frequency: np.ndarray
    ) -> TokenIdPredictor:
        """tokens (T,), ids (T, L, k) of the calibration trace -> the per-token ranking table."""
        vocab, inv = np.unique(tokens, return_inverse=True)
        ranked = min(spec.n_expert, 2 * spec.k)
        top = np.full((len(vocab), spec.n_layers, ranked), -1, np.int16)
        for j in range(spec.n_layers):  # one layer at a time: (U, E) counts stay small on big vocabularies
            counts = np.zeros((len(vocab), spec.n_expert), np.float64)
            rows, experts = np.repeat(inv, ids.shape[2]), ids[:, j].reshape(-1)
            ok = experts >= 0  # dropped slots (adaptive gating) count for nothing
            np.add.at(counts, (rows[ok], experts[ok]), 1.0)
            score = counts + 1e-3 * frequency[j][None, :]  # ties -> the more frequent expert
            order = np.argsort(-score, axis=1, kind="stable")[:, :ranked]
            seen = np.take_along_axis(counts, order, 1) > 0
            top[:, j] = np.where(seen, order, -1)
        return cls(spec, distance, vocab, top, frequency)

    def covers(self, target: int) -> bool:
        return 0 <= target < self.spec.n_layers

    def scores(self, known: Known) -> np.ndarray:
        out = np.repeat(self.frequency[known.target][None, :], known.n, axis=0)
        pos = np.searchsorted(self.vocab, known.tokens)
        pos = np.minimum(pos, len(self.vocab) - 1)
        hit = self.vocab[pos] == known.tokens
        top = self.top[pos[hit], known.target]  # (H, R)
        R = top.shape[1]
        rows = np.nonzero(hit)[0]
        for r in range(R):
            ids = top[:, r].astype(np.int64)
            ok = ids >= 0
            out[rows[ok], ids[ok]] = 2.0 + (R - r) / R
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {"vocab": self.vocab, "top": self.top, "frequency": self.frequency}

    def n_params(self) -> int:
        return int(self.top[:, 0].size)

    @classmethod
    def from_arrays(
        cls, spec: ModelSpec, distance: int, arrays: Mapping[str, np.ndarray]
    ) -> TokenIdPredictor:
        try:
            return cls(spec, distance, arrays["vocab"], arrays["top"], _frequency(spec, arrays))
        except KeyError as err:
            raise PredictorError(f"token-id artifact lacks {err}: calibrate again") from None


@register(PredictorKind.RANDOM)
class RandomPredictor(Predictor):
    """Uniform random scores: recall k/E, top-(k+m) recall (k+m)/E, exact set 1/C(E, k)."""

    distance_free = True

    def __init__(self, spec: ModelSpec, distance: int, seed: int = 0) -> None:
        super().__init__(spec, distance)
        self.rng = np.random.default_rng(seed)

    def covers(self, target: int) -> bool:
        return 0 <= target < self.spec.n_layers

    def scores(self, known: Known) -> np.ndarray:
        return self.rng.random((known.n, self.spec.n_expert), dtype=np.float32)

    def n_params(self) -> int:
        return 0
