"""Made-up routing traces for the replay mechanics of the performance model and the policies."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgemoe.analysis.trace import DECODE, PREFILL, Trace
from edgemoe.gguf.info import read_model_info


def skewed_trace(model: Path, *, n_seq: int = 4, prefill: int = 40, decode: int = 60, seed: int = 0,
                 layers: int | None = None) -> Trace:
    """A made-up trace for the replay mechanics (a Zipf-skewed router, not real routing)."""
    info = read_model_info(model)
    rng = np.random.default_rng(seed)
    n_layer = layers or len(info.moe_layers)
    e, k = info.n_expert, info.n_expert_used
    p = 1.0 / np.arange(1, e + 1) ** 1.1
    p /= p.sum()
    n = n_seq * (prefill + decode)
    ids = np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(n * n_layer)]).reshape(n, n_layer, k)
    w = np.sort(rng.dirichlet(np.ones(k), size=(n, n_layer)), axis=-1)[..., ::-1].astype(np.float32)
    phase = np.tile(np.r_[np.full(prefill, PREFILL), np.full(decode, DECODE)], n_seq).astype(np.uint8)
    seq = np.repeat(np.arange(n_seq), prefill + decode).astype(np.int32)
    return Trace(tokens=np.zeros(n, np.int32), layers=np.arange(n_layer, dtype=np.int32), ids=ids.astype(np.int32),
                 weights=w, phase=phase, seq=seq, meta={"n_expert": e, "model": "made-up"})
