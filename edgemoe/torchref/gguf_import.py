"""Load a GGUF of an architecture the torch reference implements, with dequantized weights.

The inverse of gguf_export: the fixtures (and any qwen3moe / Mixtral-style llama
GGUF whose tensors gguf-py can dequantize) become an MoEModel, for gradients.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from ..errors import UnsupportedArchitectureError
from .gguf_export import tensor_map
from .model import MoEConfig, MoEModel

SUPPORTED = ("qwen3moe", "llama")


def _field(reader: gguf.GGUFReader, key: str, default: float | int | None = None) -> float | int:
    f = reader.get_field(key)
    if f is None:
        if default is None:
            raise KeyError(key)
        return default
    return f.contents()  # type: ignore[no-any-return]


def _required(reader: gguf.GGUFReader, key: str) -> gguf.ReaderField:
    f = reader.get_field(key)
    if f is None:
        raise KeyError(key)
    return f


def config_from_gguf(reader: gguf.GGUFReader) -> MoEConfig:
    arch = str(_required(reader, gguf.Keys.General.ARCHITECTURE).contents())
    n_expert = int(_field(reader, gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch), 0))
    if arch not in SUPPORTED or n_expert == 0:
        raise UnsupportedArchitectureError(
            f"the torch reference implements MoE {', '.join(SUPPORTED)} models, not {arch!r}"
            f"{' without experts' if n_expert == 0 else ''}; use the empirical sensitivity instead"
        )
    k = gguf.Keys.LLM
    n_embd = int(_field(reader, k.EMBEDDING_LENGTH.format(arch=arch)))
    n_head = int(_field(reader, gguf.Keys.Attention.HEAD_COUNT.format(arch=arch)))
    head_dim = int(_field(reader, gguf.Keys.Attention.KEY_LENGTH.format(arch=arch), n_embd // n_head))
    n_ff_exp = (
        int(_field(reader, k.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)))
        if arch == "qwen3moe"
        else int(_field(reader, k.FEED_FORWARD_LENGTH.format(arch=arch)))
    )
    tokens = _required(reader, gguf.Keys.Tokenizer.LIST)
    return MoEConfig(
        arch=arch,
        n_vocab=len(tokens.data),
        n_embd=n_embd,
        n_layer=int(_field(reader, k.BLOCK_COUNT.format(arch=arch))),
        n_head=n_head,
        n_head_kv=int(_field(reader, gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch), n_head)),
        head_dim=head_dim,
        n_expert=n_expert,
        n_expert_used=int(_field(reader, k.EXPERT_USED_COUNT.format(arch=arch))),
        n_ff_exp=n_ff_exp,
        rope_base=float(_field(reader, gguf.Keys.Rope.FREQ_BASE.format(arch=arch), 10000.0)),
        rms_eps=float(_field(reader, gguf.Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch), 1e-6)),
        n_ctx_train=int(_field(reader, k.CONTEXT_LENGTH.format(arch=arch), 2048)),
    )


def load_gguf_model(path: str | Path) -> MoEModel:
    """An MoEModel with the GGUF's weights, dequantized to float32."""
    reader = gguf.GGUFReader(str(path))
    model = MoEModel(config_from_gguf(reader))
    data = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        for name, param in tensor_map(model):
            t = data[name]
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(param.shape))
            param.copy_(torch.from_numpy(w))
    return model.eval()
