"""Model shapes the performance model projects without the model: header-only GGUFs of the synthetic presets
(edgemoe.gguf.presets), plus shapes of published models no preset covers, written once per (shape, type) into
a directory and reused; and the tensor types of llama-quantize's *_K_M mixes, which the presets do not
write."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...gguf.presets import PRESETS, SynthPreset
from ...gguf.synth import write_synthetic
from .costmodel import ModelShape, Weights

# Qwen3.5/3.6-35B-A3B (Qwen/Qwen3.5-35B-A3B config.json: 40 layers, hidden 2048, 256 routed experts of 512,
# top-8, one shared expert of 512, vocabulary 248,320, 16 query heads of 256 with 2 KV heads). Drawn as a
# qwen2moe block: every layer gets full attention, where the real model has it on one layer in four (the other
# three are Gated DeltaNet, whose weights are about as large and which keeps no growing KV cache).
QWEN35_35B_A3B = SynthPreset(
    "qwen3.5-35b-a3b",
    "qwen2moe",
    "Qwen/Qwen3.5-35B-A3B (stand-in: qwen2moe blocks)",
    n_layer=40,
    n_embd=2048,
    n_head=16,
    n_head_kv=2,
    head_dim=256,
    n_vocab=248320,
    n_ctx_train=262144,
    n_ff=512,
    n_expert=256,
    n_expert_used=8,
    n_ff_exp=512,
    n_ff_shexp=512,
    rope_freq_base=1e7,
)
# Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 query heads of 128 with 8 KV
# heads, feed-forward 14336, vocabulary 128,256): llama.cpp's "llama 8B", the dense model of its CUDA benchmark
# tables, for the prefill backtest's dense matrices and attention
LLAMA3_8B = SynthPreset(
    "llama-3-8b", "llama", "meta-llama/Meta-Llama-3-8B",
    n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_vocab=128256, n_ctx_train=8192,
    n_ff=14336, rope_freq_base=500000.0, rms_eps=1e-5,
)  # fmt: skip

EXTRA_SHAPES = {p.name: p for p in (QWEN35_35B_A3B, LLAMA3_8B)}


def shape_preset(name: str) -> SynthPreset:
    preset = PRESETS.get(name) or EXTRA_SHAPES.get(name)
    if preset is None:
        names = ", ".join(sorted({*PRESETS, *EXTRA_SHAPES}))
        raise ValueError(f"no model shape {name!r}: choose one of {names}")
    return preset


def shape_file(name: str, qtype: str, directory: Path) -> Path:
    """The header-only GGUF of shape `name` with its large matrices in `qtype`, written on first use."""
    path = Path(directory) / f"{name}.{qtype}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(shape_preset(name), path, qtype=qtype, shape_only=True, progress=False)
    return path


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose ffn_down a *_K_M mix stores in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_BYTES_PER_256 = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def with_k_m_mix(shape: ModelShape, quant: str) -> ModelShape:
    """`shape` (written with every expert matrix in the file's main type) with a Q4_K_M or Q5_K_M file's
    expert down projections: Q6_K on the layers llama-quantize gives more bits (about half of them). Other
    quantizations are returned as they are."""
    base = quant.upper().removesuffix("_M")
    if not quant.upper().endswith("_K_M") or base not in _BYTES_PER_256:
        return shape
    moe = shape.moe_layers
    layers = list(shape.layers)
    for i, il in enumerate(moe):
        ly = layers[il]
        if len(ly.expert) != 3 or ly.expert[2].qtype != base or not _more_bits(i, len(moe)):
            continue  # gate, up, down in file order, as the presets write them
        down = Weights("Q6_K", ly.expert[2].nbytes * _BYTES_PER_256["Q6_K"] // _BYTES_PER_256[base])
        layers[il] = replace(ly, expert=(*ly.expert[:2], down))
    return replace(shape, layers=tuple(layers))
