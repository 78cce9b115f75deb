"""The KV cache types llama.cpp accepts for its K and V caches (its -ctk / -ctv names) and what a value costs in
each, for sizing the cache before a model is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# llama.cpp's names; f16 is its default. A quantized V cache needs flash attention (llama.cpp's rule).
KvCacheType = Literal["f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
KV_CACHE_TYPES: tuple[KvCacheType, ...] = get_args(KvCacheType)
# llama.cpp's flash attention setting: "auto" (its default) turns it on where the backend has the kernel for
# every layer's device (the CPU's and CUDA's have); the runtime's Engine.flash_attn says what it resolved to
FlashAttn = Literal["auto", "on", "off"]
FLASH_ATTN: tuple[FlashAttn, ...] = get_args(FlashAttn)


@dataclass(frozen=True)
class KvTypes:
    """The types of a KV cache's K and V (llama.cpp's -ctk / -ctv), for sizing it."""

    k: KvCacheType = "f16"
    v: KvCacheType = "f16"


F16_KV = KvTypes()  # llama.cpp's default

_GGML = {name: GGMLQuantizationType[name.upper()] for name in KV_CACHE_TYPES}


def ggml_type(name: KvCacheType) -> int:
    """The ggml_type id llama_context_params.type_k / type_v take."""
    return int(_GGML[name])


def is_quantized(name: KvCacheType) -> bool:
    """A block-quantized type (llama.cpp's ggml_is_quantized): a V cache of it needs flash attention."""
    return name not in ("f16", "bf16")


def block_size(name: KvCacheType) -> int:
    """Values per block: a quantized K or V cache needs a head size that is a multiple of it (1 for f16, bf16)."""
    return GGML_QUANT_SIZES[_GGML[name]][0]


def kv_bytes(name: KvCacheType, n_values: int) -> int:
    """Bytes of `n_values` cache values (a whole number of blocks) of this type: f16 2 per value, q8_0 34 per 32,
    q4_0 18 per 32."""
    block, type_size = GGML_QUANT_SIZES[_GGML[name]]
    return -(-n_values // block) * type_size
