"""Calibration: measure a model once on a corpus, keep the results in a directory with card.json.

- card: the directory, card.json, and where it is looked up (find_calibration);
- stages: the stage interface and registry (register_stage to add one);
- run: the runner (run_calibration) that builds the directory atomically;
- auto: first-use calibration (ensure_calibration) for options that need a stage the model lacks;
- traces, predictor_fit, sensitivity: the built-in stages;
- corpus: the train / held-out split of a corpus file;
- adaptive: the adaptive top-k gating policy built from a calibration directory.
"""

from __future__ import annotations

from .auto import STAGES_FOR, ensure_calibration
from .card import (
    CARD,
    FORMAT_VERSION,
    Calibration,
    CalibrationError,
    find_calibration,
    model_sha256,
    write_json,
)
from .run import DEFAULT_CTX, DEFAULT_TOKENS, CalibrationConfig, run_calibration
from .stages import Stage, StageContext, all_stages, register_stage, select_stages, unregister_stage

__all__ = [
    "CARD",
    "DEFAULT_CTX",
    "DEFAULT_TOKENS",
    "FORMAT_VERSION",
    "STAGES_FOR",
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "Stage",
    "StageContext",
    "all_stages",
    "ensure_calibration",
    "find_calibration",
    "model_sha256",
    "register_stage",
    "run_calibration",
    "select_stages",
    "unregister_stage",
    "write_json",
]
