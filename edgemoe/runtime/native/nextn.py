"""The NextN (MTP) hidden-state functions of llama.cpp's staging header src/llama-ext.h, which patch 0015 exports
under their C names: a target context hands its last hidden state to a LLAMA_CONTEXT_TYPE_MTP context on the same
model (edgemoe.runtime.mtp)."""

from __future__ import annotations

import ctypes

import numpy as np

from ...errors import EdgeMoeError
from .loader import LlamaContext, declare

# void llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
_set_embeddings_nextn = declare(
    "llama_set_embeddings_nextn", [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
)
# float * llama_get_embeddings_nextn(struct llama_context * ctx);
_get_embeddings_nextn = declare(
    "llama_get_embeddings_nextn", [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
)
# float * llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
_get_embeddings_nextn_ith = declare(
    "llama_get_embeddings_nextn_ith", [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
)
# void llama_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);
_set_nextn_layer_offset = declare("llama_set_nextn_layer_offset", [ctypes.c_void_p, ctypes.c_int32], None)

NEXTN_FUNCTIONS = (
    _set_embeddings_nextn,
    _get_embeddings_nextn,
    _get_embeddings_nextn_ith,
    _set_nextn_layer_offset,
)


def has_nextn() -> bool:
    """Whether the library exports the four functions by their C names (patch 0015)."""
    return all(fn is not None for fn in NEXTN_FUNCTIONS)


def set_embeddings_nextn(ctx: LlamaContext, on: bool, *, masked: bool) -> None:
    """Keep each decode's last hidden state (the rows an MTP head reads): of every batch token (masked False)
    or of the tokens with logits only (masked True)."""
    _set_embeddings_nextn(ctx, on, masked)


def embeddings_nextn(ctx: LlamaContext, n_rows: int, n_embd: int) -> np.ndarray:
    """A copy of the last decode's first n_rows hidden-state rows, (n_rows, n_embd) float32 (llama.cpp's buffer is
    valid only until the next decode)."""
    ptr = _get_embeddings_nextn(ctx)
    if not ptr:
        raise EdgeMoeError(
            "llama.cpp kept no NextN hidden states for the last decode (llama_set_embeddings_nextn is off)"
        )
    return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd)).copy()


def embeddings_nextn_ith(ctx: LlamaContext, i: int, n_embd: int) -> np.ndarray:
    """A copy of output i's hidden-state row of the last decode (n_embd float32)."""
    ptr = _get_embeddings_nextn_ith(ctx, i)
    if not ptr:
        raise EdgeMoeError(f"llama.cpp kept no NextN hidden state for output {i} of the last decode")
    return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()
