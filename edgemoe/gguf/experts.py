"""One MoE layer's routed experts read from a GGUF and dequantized (gguf-py), for numpy reference checks.

The experts of the architectures llama.cpp builds with separate gate, up and down tensors and SwiGLU
(qwen3moe, Mixtral-style llama, qwen2moe, olmoe, deepseek2, ...): expert e of input x (n_embd,) is
down_e(silu(gate_e x) * up_e x). Biases, per-expert scales and merged gate_up tensors (gpt-oss) are
not handled: those layers are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ExpertLayer:
    layer: int
    gate: np.ndarray  # (n_expert, n_ff, n_embd) float32
    up: np.ndarray  # (n_expert, n_ff, n_embd) float32
    down: np.ndarray  # (n_expert, n_embd, n_ff) float32
    ffn_norm: np.ndarray | None  # (n_embd,) the RMSNorm gain in front of the layer's router and experts

    def expert(self, e: int, x: np.ndarray) -> np.ndarray:
        """Expert e on x (n_tokens, n_embd) -> (n_tokens, n_embd), float64 accumulation."""
        x64 = np.asarray(x, np.float64)
        g = x64 @ self.gate[e].T.astype(np.float64)
        h = g / (1.0 + np.exp(-g)) * (x64 @ self.up[e].T.astype(np.float64))
        return h @ self.down[e].T.astype(np.float64)


def load_expert_layer(model_path: str | Path, layer: int) -> ExpertLayer:
    """Layer `layer`'s stacked expert tensors, dequantized to float32."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(model_path))
    want = {
        f"blk.{layer}.{n}.weight": n for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_norm")
    }
    refused = [
        t.name
        for t in reader.tensors
        if t.name.startswith(f"blk.{layer}.")
        and any(s in t.name for s in ("gate_up_exps", "_exps.bias", "_exps.scale"))
    ]
    if refused:
        raise UnsupportedArchitectureError(
            f"{Path(model_path).name} layer {layer} has {', '.join(refused)}: the numpy expert reference "
            "handles separate gate/up/down expert tensors without biases or scales only"
        )
    got: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in want:
            got[want[t.name]] = dequantize(t.data, t.tensor_type).astype(np.float32)
    missing = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"} - got.keys()
    if missing:
        raise UnsupportedArchitectureError(
            f"{Path(model_path).name} layer {layer} lacks {sorted(missing)}: not a routed-expert layer this "
            "reference reads"
        )
    norm = got.get("ffn_norm")
    return ExpertLayer(
        layer,
        got["ffn_gate_exps"],
        got["ffn_up_exps"],
        got["ffn_down_exps"],
        None if norm is None else norm.reshape(-1),
    )
