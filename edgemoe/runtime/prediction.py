"""Expert predictors evaluated inside llama.cpp's graph.

GraphPredictors is a part of Engine (engine.prefetch, edgemoe.runtime.engine). `set` registers the
mlp, gate and residual predictors (edgemoe.predictors) with llama.cpp: for each covered target
MoE layer l+d, the predictor runs on layer l's router input on that layer's device, right
where the layer routes, and its top-n_out ids are copied to the host after the graph, without a
host round trip per layer. `predictions(il)` reads the last ubatch's ids. Engine.set_predictors,
predictions, predictor_targets and predictor_bytes call it.

The kinds that predict from the current token's router input of an earlier layer can run in the
graph; the others (first-layer, which reads the previous token, and the token-level baselines)
cannot, and set says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import EdgeMoeError
from ..gguf.info import ModelInfo
from ..predictors.base import Predictor
from ..predictors.gate import GatePredictor, ResidualPredictor
from ..predictors.mlp import MLPPredictor
from . import native
from .handle import NativeHandle

# storage of the predictor matrices (w1, w2, skip): f32 computes as numpy does; f16 halves the bytes, q8_0
# quarters them (the activations are rounded to the same type on the CPU)
WEIGHT_TYPES = {name: native.GGML_TYPES[name.upper()] for name in ("f32", "f16", "q8_0")}


def default_n_out(k: int) -> int:
    """top-(k+m) with m = max(1, k/2): predict-eval's recall_km (6 for k = 4, 3 for k = 2, 12 for k = 8)."""
    return k + max(1, k // 2)


@dataclass(frozen=True)
class NativePredictor:
    """What llama_moe_set_predictor takes for one target layer: float32 arrays in the C layout (row-major)."""

    il_src: int  # model layer whose router input the prediction reads
    il_target: int  # model layer whose experts are predicted
    n_out: int  # top-n_out ids, best first
    w1: np.ndarray | None  # (n_hidden, n_embd); None: a linear predictor (skip h + b2)
    b1: np.ndarray | None  # (n_hidden,)
    w2: np.ndarray | None  # (n_expert, n_hidden)
    b2: np.ndarray | None  # (n_expert,)
    skip: np.ndarray | None  # (n_expert, n_embd); None: il_target's own router, read where it is

    def nbytes(self, weights: str = "f32") -> int:
        """Device bytes of the stored weights (matrices in `weights`, biases F32), before buffer alignment."""
        mats = [a for a in (self.w1, self.w2, self.skip) if a is not None]
        vecs = [a for a in (self.b1, self.b2) if a is not None]
        per = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}[weights]
        return int(sum(a.size * per for a in mats)) + sum(a.nbytes for a in vecs)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def native_predictors(predictors: Sequence[Predictor], *, n_out: int) -> list[NativePredictor]:
    """One NativePredictor per covered target layer of each predictor, in the C layout.

    Raises EdgeMoeError for a kind that cannot run in the graph, and for two predictors of one target.
    """
    out: dict[int, NativePredictor] = {}
    for pred in predictors:
        if not isinstance(pred, (MLPPredictor, GatePredictor, ResidualPredictor)):
            raise EdgeMoeError(
                f"the {pred.kind.value} predictor cannot run inside llama.cpp's graph: only mlp, gate "
                "and residual predict from the same token's router input of an earlier layer (first-layer "
                "reads the previous token's, the baselines no router input); use its numpy scores() instead"
            )
        spec, d = pred.spec, pred.distance
        if not 1 <= n_out <= spec.n_expert:
            raise EdgeMoeError(f"n_out {n_out}: predict between 1 and {spec.n_expert} experts per token")
        for target in range(spec.n_layers):
            if not pred.covers(target):
                continue
            src_il, target_il = spec.layers[target - d], spec.layers[target]
            if target_il in out:
                raise EdgeMoeError(
                    f"two predictors for layer {target_il} (MoE layer {target}): llama.cpp "
                    "runs one per target layer; pass predictors of one distance"
                )
            if isinstance(pred, MLPPredictor):
                p = target - d
                native_pred = NativePredictor(
                    src_il,
                    target_il,
                    n_out,
                    _f32(pred.w1[p].T),
                    _f32(pred.b1[p]),
                    _f32(pred.w2[p].T),
                    _f32(pred.b2[p]),
                    _f32(pred.skip[p].T),
                )
            elif isinstance(pred, ResidualPredictor):
                # R (h + r) = R h + R r: the router where it is, and a bias
                bias = _f32(spec.router(target) @ pred.res_vec[target])
                native_pred = NativePredictor(src_il, target_il, n_out, None, None, None, bias, None)
            else:
                native_pred = NativePredictor(src_il, target_il, n_out, None, None, None, None, None)
            out[target_il] = native_pred
    return [out[il] for il in sorted(out)]


def device_bytes(predictors: Sequence[Predictor], *, n_out: int, weights: str = "f32") -> int:
    """Device memory the predictors' weights will take in the graph (for --vram, before loading)."""
    return sum(p.nbytes(weights) for p in native_predictors(predictors, n_out=n_out))


class GraphPredictors:
    """The expert predictors in one context's graph (engine.prefetch): their target layers and ids per token."""

    def __init__(self, handle: NativeHandle, info: ModelInfo) -> None:
        self.handle = handle
        self.info = info
        self._n_out: dict[int, int] = {}  # target layer -> ids per token of its predictor in the graph
        # what set() was last given (reapply(): on a new context of the same model)
        self._given: tuple[list[Predictor], int | None, str] | None = None

    def set(
        self, predictors: Sequence[Predictor] | None, *, n_out: int | None = None, weights: str = "f32"
    ) -> list[int]:
        """Run these predictors inside llama.cpp's graph (None or []: none); returns their target layers (il).

        n_out: ids per token and target, best first (default top-(k+m), default_n_out); weights: how the
        predictor matrices are stored on the device ("f32": the numpy predictors' results up to summation
        order; "f16", "q8_0": fewer bytes, rounded activations). Replaces the predictors set before.
        """
        if weights not in WEIGHT_TYPES:
            raise EdgeMoeError(f"predictor weights {weights!r}: use one of {', '.join(WEIGHT_TYPES)}")
        native.moe_clear_predictors(self.handle.ctx)
        self._n_out = {}
        self._given = None
        if not predictors:
            return []
        for pred in predictors:
            self._check_spec(pred)
        k = predictors[0].spec.k
        nps = native_predictors(predictors, n_out=n_out if n_out is not None else default_n_out(k))
        for p in nps:
            self._set_one(p, weights)
        self._given = (list(predictors), n_out, weights)
        return sorted(self._n_out)

    def reapply(self) -> None:
        """Put the predictors set last into the handle's context again (after it was re-created)."""
        if self._given is not None:
            predictors, n_out, weights = self._given
            self.set(predictors, n_out=n_out, weights=weights)

    def _set_one(self, p: NativePredictor, weights: str) -> None:
        ctx = self.handle.ctx
        mark = native.log_mark()
        rc = native.moe_set_predictor(
            ctx, p.il_src, p.il_target, p.n_out, WEIGHT_TYPES[weights], p.w1, p.b1, p.w2, p.b2, p.skip
        )
        if rc != 0:
            native.moe_clear_predictors(ctx)
            self._n_out = {}
            why = (
                "out of device memory: use weights='f16' or 'q8_0', or fewer target layers"
                if rc == -2
                else native.recent_error(mark)
            )
            raise EdgeMoeError(
                f"llama.cpp refused the predictor of layer {p.il_target} from layer "
                f"{p.il_src} ({weights} weights): {why}"
            )
        self._n_out[p.il_target] = p.n_out

    def _check_spec(self, pred: Predictor) -> None:
        spec, info = pred.spec, self.info
        mine = (tuple(info.moe_layers), info.n_expert, info.n_embd)
        theirs = (tuple(spec.layers), spec.n_expert, spec.n_embd)
        if mine != theirs:
            raise EdgeMoeError(
                f"the {pred.kind.value} predictor was made for another model shape (MoE "
                f"layers, experts, width: {theirs} vs {self.handle.name}'s {mine}): load it "
                "for this model (Calibration.predictors or spec_for_model)"
            )

    @property
    def targets(self) -> list[int]:
        """The layers (il) with a predictor in the graph."""
        return sorted(self._n_out)

    def predictions(self, target_il: int) -> np.ndarray:
        """The last ubatch's predicted experts of layer target_il: (n_tokens, n_out) int32, best first.

        n_tokens are the ubatch's tokens routed at the source layer (zero rows before a decode).
        """
        n_out = self._n_out.get(target_il)
        ids = native.moe_get_predictions(self.handle.ctx, target_il, n_out) if n_out is not None else None
        if ids is None:
            have = ", ".join(map(str, self.targets)) or "none"
            raise EdgeMoeError(
                f"layer {target_il} has no predictor in the graph (layers with one: {have}); "
                "call set_predictors first"
            )
        return ids

    def nbytes(self) -> int:
        """Device memory of the predictors' weights (what counts against --vram)."""
        return native.moe_predictor_bytes(self.handle.ctx)
