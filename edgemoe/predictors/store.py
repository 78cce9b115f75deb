"""Predictor artifacts: one .npz of plain arrays per (kind, distance) in a calibration directory's
`predictors/` folder, listed in card.json; loading needs numpy and the model's routers only."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from .base import ModelSpec, Predictor, PredictorError, parse_kind
from .registry import create_predictor, predictor_class

SUBDIR = "predictors"


def spec_for_model(model_path: str | os.PathLike[str], *, routers: bool = True) -> ModelSpec:
    """The ModelSpec of a GGUF: MoE layers, experts, top-k, width, and (by default) its routers."""
    from ..gguf.info import read_model_info
    from ..gguf.routers import load_routers

    info = read_model_info(Path(model_path))
    if not info.is_moe:
        raise PredictorError(f"{Path(model_path).name} is a dense model: there are no experts to predict")
    layers = tuple(int(x) for x in info.moe_layers)
    R = None
    if routers:
        by_il = load_routers(str(model_path), list(layers))
        R = {j: by_il[il] for j, il in enumerate(layers)}
    return ModelSpec(
        layers=layers, n_expert=info.n_expert, k=info.n_expert_used, n_embd=info.n_embd, routers=R
    )


def artifact_name(pred: Predictor) -> str:
    kind = pred.kind.value
    return f"{kind}.npz" if pred.distance_free else f"{kind}-d{pred.distance}.npz"


def save_predictors(preds: Sequence[Predictor], out_dir: Path) -> list[dict[str, Any]]:
    """Write each predictor's arrays under out_dir/predictors/; returns the card entries."""
    folder = out_dir / SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    written: set[str] = set()
    for p in preds:
        arrays = p.arrays()
        rel = None
        if arrays:
            rel = f"{SUBDIR}/{artifact_name(p)}"
            if rel not in written:  # distance-free kinds share one file
                with (out_dir / rel).open("wb") as f:
                    np.savez_compressed(f, **cast("dict[str, Any]", arrays))  # the stub's allow_pickle: bool
                written.add(rel)
        entries.append({**p.describe(), "file": rel, "params_per_layer": p.n_params()})
    return entries


def _read(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as err:
        raise PredictorError(
            f"cannot read predictor artifact {path}: {err}; run `edgemoe calibrate` again"
        ) from err


def load_predictors(
    calib_dir: Path,
    entries: Iterable[Mapping[str, Any]],
    spec: ModelSpec,
    *,
    kinds: Iterable[str] | None = None,
    distances: Iterable[int] | None = None,
) -> list[Predictor]:
    """Predictors from card entries ({kind, distance, file}); optionally only some kinds / distances."""
    want_kinds = None if kinds is None else {parse_kind(k) for k in kinds}
    want_d = None if distances is None else set(distances)
    cache: dict[str, dict[str, np.ndarray]] = {}
    out = []
    for e in entries:
        kind = parse_kind(e["kind"])
        d = int(e["distance"])
        if (want_kinds is not None and kind not in want_kinds) or (want_d is not None and d not in want_d):
            continue
        arrays: dict[str, np.ndarray] = {}
        if e.get("file"):
            rel = str(e["file"])
            if rel not in cache:
                cache[rel] = _read(calib_dir / rel)
            arrays = cache[rel]
        elif predictor_class(kind).trained:
            raise PredictorError(
                f"{calib_dir}/card.json lists {kind.value} d={d} without a file: calibrate again"
            )
        out.append(create_predictor(kind, spec, d, arrays))
    return out


CARD = "card.json"  # the calibration directory's card (edgemoe.calibration.card), which lists the artifacts


def load_calibrated(calib_dir: Path, spec: ModelSpec, kind: str, distance: int) -> Predictor | None:
    """The predictor of `kind` at `distance` that calib_dir's card lists, or None when it lists none."""
    try:
        card = json.loads((calib_dir / CARD).read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise PredictorError(f"cannot read {calib_dir / CARD}: {err}; run `edgemoe calibrate` again") from err
    entries = card.get("predictors", {}).get("files", [])
    found = load_predictors(calib_dir, entries, spec, kinds=[kind], distances=[distance])
    return found[0] if found else None
