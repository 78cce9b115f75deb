"""Model shapes the performance model projects without the model: header-only GGUFs of the synthetic presets
(edgemoe.gguf.presets), plus shapes of published models no preset covers, written once per (shape, type) into
a directory and reused."""
from __future__ import annotations

from pathlib import Path

from ..gguf.presets import PRESETS, SynthPreset
from ..gguf.synth import write_synthetic

# Qwen3.5/3.6-35B-A3B (Qwen/Qwen3.5-35B-A3B config.json: 40 layers, hidden 2048, 256 routed experts of 512, top-8,
# one shared expert of 512, vocabulary 248,320, 16 query heads of 256 with 2 KV heads). Drawn as a qwen2moe
# block: every layer gets full attention, where the real model has it on one layer in four (the other three are
# Gated DeltaNet, whose weights are about as large and which keeps no growing KV cache).
QWEN35_35B_A3B = SynthPreset("qwen3.5-35b-a3b", "qwen2moe", "Qwen/Qwen3.5-35B-A3B (stand-in: qwen2moe blocks)",
                             n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_vocab=248320,
                             n_ctx_train=262144, n_ff=512, n_expert=256, n_expert_used=8, n_ff_exp=512,
                             n_ff_shexp=512, rope_freq_base=1e7)
EXTRA_SHAPES = {p.name: p for p in (QWEN35_35B_A3B,)}


def shape_preset(name: str) -> SynthPreset:
    preset = PRESETS.get(name) or EXTRA_SHAPES.get(name)
    if preset is None:
        raise ValueError(f"no model shape {name!r}: choose one of {', '.join(sorted({*PRESETS, *EXTRA_SHAPES}))}")
    return preset


def shape_file(name: str, qtype: str, directory: Path) -> Path:
    """The header-only GGUF of shape `name` with its large matrices in `qtype`, written on first use."""
    path = Path(directory) / f"{name}.{qtype}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(shape_preset(name), path, qtype=qtype, shape_only=True, progress=False)
    return path
