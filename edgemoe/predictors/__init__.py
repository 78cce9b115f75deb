"""Expert predictors: score the experts of MoE layer l+d from what is known at layer l.

Kinds (PredictorKind): mlp (ProMoE), gate (AdapMoE / DAOP gate reuse), residual (DALI),
prev-token, token-id (ProMoE's token-based baseline), first-layer (AdapMoE eq. 9), random.
Trained by `edgemoe calibrate` (torch, edgemoe.predictors.train), stored as numpy arrays,
evaluated by `edgemoe predict-eval` (edgemoe.analysis.predictor_eval), fitted by the
calibration stage edgemoe.calibration.predictor_fit. See docs/predictors.md.

Importing this package does not import torch.
"""

from __future__ import annotations

from .base import Known, ModelSpec, Predictor, PredictorError, PredictorKind, parse_kind, source_of, topk_ids

# importing each kind registers it: after this package's import the registry is complete
from .baselines import PrevTokenPredictor, RandomPredictor, TokenIdPredictor
from .first_layer import FirstLayerPredictor
from .gate import GatePredictor, ResidualPredictor
from .mlp import MLPPredictor, mlp_hidden
from .registry import create_predictor, predictor_class
from .store import load_predictors, save_predictors, spec_for_model

__all__ = [
    "FirstLayerPredictor",
    "GatePredictor",
    "Known",
    "MLPPredictor",
    "ModelSpec",
    "Predictor",
    "PredictorError",
    "PredictorKind",
    "PrevTokenPredictor",
    "RandomPredictor",
    "ResidualPredictor",
    "TokenIdPredictor",
    "create_predictor",
    "load_predictors",
    "mlp_hidden",
    "parse_kind",
    "predictor_class",
    "save_predictors",
    "source_of",
    "spec_for_model",
    "topk_ids",
]
