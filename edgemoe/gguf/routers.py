"""Router weights (ffn_gate_inp) of the MoE layers, read from a GGUF file."""

from __future__ import annotations

import numpy as np


def load_routers(model_path: str, layers: list[int]) -> dict[int, np.ndarray]:
    """The router weight (ffn_gate_inp, as (n_expert, n_embd) float32) of each MoE layer, from the GGUF."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(model_path)
    want = {f"blk.{il}.ffn_gate_inp.weight": il for il in layers}
    out: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in want:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            out[want[t.name]] = w.reshape(int(t.shape[1]), int(t.shape[0]))
    return out
