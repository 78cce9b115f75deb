"""Random weights generated directly in ggml block formats (no float round trip).

Quant bytes are uniform random; the per-block scale fields are set so that the
dequantized weights have a std of about `TARGET_STD` (a typical init scale) and are
always finite. Block layouts follow vendor/llama.cpp/ggml/src/ggml-common.h.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
TARGET_STD = 0.02
CHUNK_BYTES = 32 * 2**20  # generated and written per step; bounds memory use

# std of the integer grid each format multiplies by its scales (uniform random codes)
_STD_INT8 = float(np.sqrt((256**2 - 1) / 12))  # Q8_0: q in -128..127
_STD_U4 = float(np.sqrt((16**2 - 1) / 12))  # 4-bit codes 0..15
_STD_U5 = float(np.sqrt((32**2 - 1) / 12))  # 5-bit codes 0..31
_STD_U6 = float(np.sqrt((64**2 - 1) / 12))  # Q6_K: q in 0..63, centred by -32

# K-quant 6-bit sub-block scales/mins packed into 12 bytes (get_scale_min_k4):
# every one of the 8 sub-blocks gets scale 16 and min 16.
_K_SCALES_16 = np.array([80] * 8 + [0] * 4, dtype=np.uint8)
_Q6_K_SCALE = 8  # int8 sub-block scale of every Q6_K sub-block


def _raw(rng: np.random.Generator, n_blocks: int, type_size: int) -> np.ndarray:
    """(n_blocks, type_size) uniform random bytes, writable."""
    n = n_blocks * type_size
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n].reshape(n_blocks, type_size)


def _scales(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    # +-25% per block, so blocks do not all share one scale
    return (base * rng.uniform(0.75, 1.25, n)).astype(np.float32)


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _q8_0(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 34)  # d f16, qs int8[32]
    _put_f16(b, 0, _scales(rng, n, TARGET_STD / _STD_INT8))
    return b


def _q5_0(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 22)  # d f16, qh[4], qs[16]; w = d * (q - 16)
    _put_f16(b, 0, _scales(rng, n, TARGET_STD / _STD_U5))
    return b


def _q5_1(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 24)  # d f16, m f16, qh[4], qs[16]; w = d * q + m
    d = _scales(rng, n, TARGET_STD / _STD_U5)
    _put_f16(b, 0, d)
    _put_f16(b, 2, -15.5 * d)  # centre the 0..31 codes
    return b


def _q4_k(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 144)  # d, dmin, scales[12], qs[128]; w = d*16*q - dmin*16
    d = _scales(rng, n, TARGET_STD / (16 * _STD_U4))
    _put_f16(b, 0, d)
    _put_f16(b, 2, 7.5 * d)  # dmin: centres the 0..15 codes
    b[:, 4:16] = _K_SCALES_16
    return b


def _q5_k(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 176)  # d, dmin, scales[12], qh[32], qs[128]
    d = _scales(rng, n, TARGET_STD / (16 * _STD_U5))
    _put_f16(b, 0, d)
    _put_f16(b, 2, 15.5 * d)
    b[:, 4:16] = _K_SCALES_16
    return b


def _q6_k(rng: np.random.Generator, n: int) -> np.ndarray:
    b = _raw(rng, n, 210)  # ql[128], qh[64], scales int8[16], d f16; w = d*sc*(q-32)
    b[:, 192:208] = _Q6_K_SCALE
    _put_f16(b, 208, _scales(rng, n, TARGET_STD / (_Q6_K_SCALE * _STD_U6)))
    return b


def _mxfp4(rng: np.random.Generator, n: int) -> np.ndarray:
    # e (E8M0 exponent), qs[16] FP4 E2M1 codes; w = kvalue[q] * 2**(e - 128) with
    # kvalues {0,1,2,3,4,6,8,12} (+-): std 5.85 * 2**(e-128), ~0.02 for this e mix
    b = _raw(rng, n, 17)
    b[:, 0] = rng.choice(np.array([119, 120], dtype=np.uint8), size=n, p=[0.3, 0.7])
    return b


_BLOCK_MAKERS: dict[Q, Callable[[np.random.Generator, int], np.ndarray]] = {
    Q.Q8_0: _q8_0,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: _mxfp4,
}
_FLOATS: dict[Q, str] = {Q.F32: "<f4", Q.F16: "<f2"}
SUPPORTED_TYPES: tuple[Q, ...] = tuple(_FLOATS) + tuple(_BLOCK_MAKERS)


def iter_random_tensor(
    qtype: Q, n_elements: int, rng: np.random.Generator, *, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[np.ndarray]:
    """Yield the tensor's bytes (uint8 arrays) in chunks of at most ~chunk_bytes."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n_elements % block:
        raise ValueError(f"{n_elements} elements are not a multiple of {qtype.name} block size ({block})")
    n_blocks = n_elements // block
    per_chunk = max(1, chunk_bytes // type_size)
    for start in range(0, n_blocks, per_chunk):
        n = min(per_chunk, n_blocks - start)
        if qtype in _FLOATS:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(TARGET_STD)
            yield values.astype(_FLOATS[qtype]).view(np.uint8)
        elif qtype in _BLOCK_MAKERS:
            yield _BLOCK_MAKERS[qtype](rng, n).reshape(-1)
        else:
            raise ValueError(
                f"random {qtype.name} weights are not implemented; use one of "
                + ", ".join(t.name for t in SUPPORTED_TYPES)
            )


def constant_f32(n_elements: int, value: float) -> np.ndarray:
    """Bytes of an F32 tensor filled with `value` (norm weights are ones)."""
    return np.full(n_elements, value, dtype="<f4").view(np.uint8)
