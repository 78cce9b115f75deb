"""One layer's attention as llama.cpp's CPU graph computes it, with and without flash attention.

llama.cpp's attention (build_attn_mha) for `tokens` new tokens over `n_kv` cached ones (F16 K and V):
- flash attention: one ggml_flash_attn_ext of the permuted Q [d, tokens, heads] over K and V views
  [d, n_kv, kv_heads], with an F16 mask;
- without: K^T Q (ggml_mul_mat, the KV heads broadcast over the query heads), ggml_soft_max_ext with an F32
  mask and the 1/sqrt(d) scale, V^T (the cache stores V transposed) times the probabilities, and a ggml_cont
  of the permuted result.
`time_attention` times both graphs at a few cache lengths (the medians of individually timed computes, as
edgemoe.perf.measure.microbench times its products) for a model's head counts and head size.

In a model's decode every layer reads its own cache after the rest of the layer's weights streamed through, so
the cache comes from memory: given pool_bytes, each call computes the next of a pool of graphs whose caches
hold that many bytes in all. The caches hold random values (zeros speed the path without flash attention up
by a third on an AMD EPYC).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from ...errors import EdgeMoeError
from ...runtime import native
from ..model.profile import AttentionTimes
from . import ggml_graph
from .microbench import Backend, median_call, open_backend

# the graph's KV lengths timed: llama.cpp's padding step, where ggml's CPU kernel splits the cache between the
# threads (512 on), and two longer contexts
DECODE_KV = (256, 512, 1024, 4096)
ROUNDS = 3  # timings of each point, the least kept
MAX_POOL = 1024  # graphs in a cold pool, whatever its bytes


@dataclass(frozen=True)
class AttentionShape:
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (grouped-query attention: n_head is a multiple of it)
    head_dim: int  # K and V row length per head

    @property
    def valid(self) -> bool:
        return min(self.n_head, self.n_head_kv, self.head_dim) > 0 and self.n_head % self.n_head_kv == 0


DEFAULT_SHAPE = AttentionShape(32, 4, 128)  # Qwen3-30B-A3B's


def cache_bytes(shape: AttentionShape, n_kv: int) -> int:
    """The F16 K and V one layer's graph reads over n_kv cached tokens."""
    return 2 * 2 * shape.n_head_kv * shape.head_dim * n_kv


def _inputs(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    return rng.standard_normal(n).astype(dtype)


def _graph(
    be: Backend,
    stack: ExitStack,
    shape: AttentionShape,
    tokens: int,
    n_kv: int,
    flash: bool,
    values: dict[str, np.ndarray],
) -> int:
    """The attention graph of `tokens` queries over `n_kv` cached tokens, its inputs set (Q, K and V from
    `values`, made once per shape and length and shared by a pool; a mask that hides nothing); returns the
    graph."""
    d, h, hkv = shape.head_dim, shape.n_head, shape.n_head_kv
    f16, f32 = native.GGML_TYPES["F16"], native.GGML_TYPE_F32
    ctx = ggml_graph.ggml_context(16, graph_size=16)
    stack.callback(ggml_graph.ggml_context_free, ctx)
    axes = (0, 2, 1, 3)
    q_in = ggml_graph.ggml_new_tensor(ctx, f32, (d, h, tokens))
    k_in = ggml_graph.ggml_new_tensor(ctx, f16, (d, hkv, n_kv))
    q, k = ggml_graph.ggml_permute(ctx, q_in, axes), ggml_graph.ggml_permute(ctx, k_in, axes)
    mask = ggml_graph.ggml_new_tensor(ctx, f16 if flash else f32, (n_kv, tokens))
    scale = 1.0 / math.sqrt(d)
    if flash:
        v_in = ggml_graph.ggml_new_tensor(ctx, f16, (d, hkv, n_kv))
        out = ggml_graph.ggml_flash_attn_ext(ctx, q, k, ggml_graph.ggml_permute(ctx, v_in, axes), mask, scale)
    else:
        v_in = ggml_graph.ggml_new_tensor(ctx, f16, (n_kv, d, hkv))  # V^T: llama.cpp's layout without it
        kq = ggml_graph.ggml_soft_max_ext(ctx, ggml_graph.ggml_mul_mat(ctx, k, q), mask, scale)
        out = ggml_graph.ggml_cont(
            ctx, ggml_graph.ggml_permute(ctx, ggml_graph.ggml_mul_mat(ctx, v_in, kq), axes)
        )
    graph = ggml_graph.ggml_graph(ctx, [out], 16)
    buffer = ggml_graph.alloc_ctx_tensors(ctx, be.compute_buft)
    stack.callback(ggml_graph.buffer_free, buffer)
    ggml_graph.buffer_clear(buffer, 0)  # the mask: zeros hide nothing
    for tensor, name in ((q_in, "q"), (k_in, "kv"), (v_in, "kv")):
        data = values[name]
        ggml_graph.tensor_set(tensor, data.ctypes.data, 0, data.nbytes)
    return graph


def pool_size(shape: AttentionShape, n_kv: int, pool_bytes: int) -> int:
    """Graphs to rotate over so that their caches reach pool_bytes (0: one, its cache staying in a cache)."""
    return max(1, min(MAX_POOL, math.ceil(pool_bytes / cache_bytes(shape, n_kv))))


def time_attention(
    shape: AttentionShape,
    kv_lengths: Sequence[int],
    *,
    threads: int,
    flash: bool,
    tokens: int = 1,
    min_seconds: float = 0.03,
    pool_bytes: int = 0,
) -> dict[int, float]:
    """Seconds of one layer's attention of `tokens` new tokens over each cache length of kv_lengths, on the
    CPU backend with `threads` threads; flash: ggml_flash_attn_ext, else llama.cpp's mul_mat/softmax path.
    pool_bytes: the caches each call's comes after (a model's other layers'), 0 for one cache read again."""
    if not shape.valid:
        raise EdgeMoeError(
            f"attention shape {shape}: the query heads must be a positive multiple of the KV heads"
        )
    if tokens < 1 or not kv_lengths or min(kv_lengths) < 1:
        raise EdgeMoeError(f"tokens={tokens}, kv_lengths={list(kv_lengths)}: give positive counts")
    out: dict[int, float] = {}
    rng = np.random.default_rng(3)
    with ExitStack() as stack:
        be = stack.enter_context(open_backend(threads, None))
        for n_kv in sorted(set(kv_lengths)):
            values = {
                "q": _inputs(rng, shape.head_dim * shape.n_head * tokens, np.float32),
                "kv": _inputs(rng, shape.head_dim * shape.n_head_kv * n_kv, np.float16),
            }
            with ExitStack() as per:
                graphs = [
                    _graph(be, per, shape, tokens, n_kv, flash, values)
                    for _ in range(pool_size(shape, n_kv, pool_bytes))
                ]
                out[n_kv] = _rotating_median(be, graphs, min_seconds)
    return out


def _rotating_median(be: Backend, graphs: list[int], min_seconds: float) -> float:
    """median_call's seconds of a compute of the graphs in turn, each call the next one's."""
    current = [graphs[0]]

    def prepare(i: int) -> None:
        current[0] = graphs[i % len(graphs)]

    return median_call(lambda: ggml_graph.graph_compute(be.handle, current[0]), prepare, min_seconds)


def measure_decode_attention(
    *,
    threads: int,
    shapes: Sequence[tuple[AttentionShape, int]],
    rounds: int = ROUNDS,
    min_seconds: float = 0.03,
    overhead_s: float = 0.0,
) -> tuple[AttentionTimes, ...]:
    """One decode token's attention per layer at DECODE_KV, with and without flash attention, for each
    (shape, pool_bytes) (the profile's `decode_attention`; pool_bytes as time_attention takes it): each point
    the least of `rounds` timings, taken in turn (a busy machine only slows a timing down), less overhead_s, a
    one-node graph's compute call and node dispatch (priced apart, per decode and per node), but at least half
    the timing."""
    out = []
    for shape, pool_bytes in dict.fromkeys(shapes):
        best = {flash: dict.fromkeys(DECODE_KV, math.inf) for flash in (True, False)}
        for _ in range(rounds):
            for flash, times in best.items():
                t = time_attention(
                    shape,
                    DECODE_KV,
                    threads=threads,
                    flash=flash,
                    min_seconds=min_seconds,
                    pool_bytes=pool_bytes,
                )
                for n in DECODE_KV:
                    times[n] = min(times[n], t[n])
        out.append(
            AttentionTimes(
                n_head=shape.n_head,
                n_head_kv=shape.n_head_kv,
                head_dim=shape.head_dim,
                n_kv=DECODE_KV,
                flash_s=tuple(max(best[True][n] - overhead_s, best[True][n] / 2) for n in DECODE_KV),
                plain_s=tuple(max(best[False][n] - overhead_s, best[False][n] / 2) for n in DECODE_KV),
                pool_bytes=pool_bytes,
            )
        )
    return tuple(out)


def describe(times: AttentionTimes) -> str:
    """One line: the measured shape's decode attention per layer at each KV length, flash / without."""
    points = ", ".join(
        f"{n}: {f * 1e6:.0f}/{p * 1e6:.0f}"
        for n, f, p in zip(times.n_kv, times.flash_s, times.plain_s, strict=True)
    )
    where = f"caches from a {times.pool_bytes >> 20} MiB pool" if times.pool_bytes else "one cache, hot"
    return (
        f"decode attention per layer, {times.n_head} heads ({times.n_head_kv} KV) of {times.head_dim} ({where}), "
        f"us with/without flash attention by KV length: {points}"
    )
