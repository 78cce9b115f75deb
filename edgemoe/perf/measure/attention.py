"""One layer's attention as llama.cpp's CPU graph computes it, with and without flash attention.

llama.cpp's attention (build_attn_mha) for `tokens` new tokens over `n_kv` cached ones (F16 K and V):
- flash attention: one ggml_flash_attn_ext of the permuted Q [d, tokens, heads] over K and V views
  [d, n_kv, kv_heads], with an F16 mask;
- without: K^T Q (ggml_mul_mat, the KV heads broadcast over the query heads), ggml_soft_max_ext with an F32
  mask and the 1/sqrt(d) scale, V^T (the cache stores V transposed) times the probabilities, and a ggml_cont
  of the permuted result.
`time_attention` times both graphs at a few cache lengths (the medians of individually timed computes, as
edgemoe.perf.measure.microbench times its products) for a model's head counts and head size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from ...errors import EdgeMoeError
from ...runtime import native
from ..model.profile import AttentionTimes
from . import ggml_graph
from .microbench import Backend, median_call, open_backend

# the graph's KV lengths timed: llama.cpp's padding step, where ggml's CPU kernel splits the cache between the
# threads (512 on), and two longer contexts
DECODE_KV = (256, 512, 1024, 4096)
ROUNDS = 3  # timings of each point, the least kept


@dataclass(frozen=True)
class AttentionShape:
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (grouped-query attention: n_head is a multiple of it)
    head_dim: int  # K and V row length per head

    @property
    def valid(self) -> bool:
        return min(self.n_head, self.n_head_kv, self.head_dim) > 0 and self.n_head % self.n_head_kv == 0


DEFAULT_SHAPE = AttentionShape(32, 4, 128)  # Qwen3-30B-A3B's


def _graph(be: Backend, stack: ExitStack, shape: AttentionShape, tokens: int, n_kv: int, flash: bool) -> int:
    """The attention graph of `tokens` queries over `n_kv` cached tokens, its inputs set; returns the graph."""
    d, h, hkv = shape.head_dim, shape.n_head, shape.n_head_kv
    f16, f32 = native.GGML_TYPES["F16"], native.GGML_TYPE_F32
    ctx = ggml_graph.ggml_context(16, graph_size=16)
    stack.callback(ggml_graph.ggml_context_free, ctx)
    axes = (0, 2, 1, 3)
    q = ggml_graph.ggml_permute(ctx, ggml_graph.ggml_new_tensor(ctx, f32, (d, h, tokens)), axes)
    k = ggml_graph.ggml_permute(ctx, ggml_graph.ggml_new_tensor(ctx, f16, (d, hkv, n_kv)), axes)
    mask = ggml_graph.ggml_new_tensor(ctx, f16 if flash else f32, (n_kv, tokens))
    scale = 1.0 / math.sqrt(d)
    if flash:
        v = ggml_graph.ggml_permute(ctx, ggml_graph.ggml_new_tensor(ctx, f16, (d, hkv, n_kv)), axes)
        out = ggml_graph.ggml_flash_attn_ext(ctx, q, k, v, mask, scale)
    else:
        v_t = ggml_graph.ggml_new_tensor(ctx, f16, (n_kv, d, hkv))  # V^T: llama.cpp's layout without it
        kq = ggml_graph.ggml_soft_max_ext(ctx, ggml_graph.ggml_mul_mat(ctx, k, q), mask, scale)
        out = ggml_graph.ggml_cont(
            ctx, ggml_graph.ggml_permute(ctx, ggml_graph.ggml_mul_mat(ctx, v_t, kq), axes)
        )
    graph = ggml_graph.ggml_graph(ctx, [out], 16)
    buffer = ggml_graph.alloc_ctx_tensors(ctx, be.compute_buft)
    stack.callback(ggml_graph.buffer_free, buffer)
    ggml_graph.buffer_clear(buffer, 0)  # zeros: finite K, V and Q, and a mask that hides nothing
    return graph


def time_attention(
    shape: AttentionShape,
    kv_lengths: Sequence[int],
    *,
    threads: int,
    flash: bool,
    tokens: int = 1,
    min_seconds: float = 0.03,
) -> dict[int, float]:
    """Seconds of one layer's attention of `tokens` new tokens over each cache length of kv_lengths, on the
    CPU backend with `threads` threads; flash: ggml_flash_attn_ext, else llama.cpp's mul_mat/softmax path."""
    if not shape.valid:
        raise EdgeMoeError(
            f"attention shape {shape}: the query heads must be a positive multiple of the KV heads"
        )
    if tokens < 1 or not kv_lengths or min(kv_lengths) < 1:
        raise EdgeMoeError(f"tokens={tokens}, kv_lengths={list(kv_lengths)}: give positive counts")
    out: dict[int, float] = {}
    with ExitStack() as stack:
        be = stack.enter_context(open_backend(threads, None))
        for n_kv in sorted(set(kv_lengths)):
            with ExitStack() as per:
                graph = _graph(be, per, shape, tokens, n_kv, flash)
                out[n_kv] = median_call(
                    lambda graph=graph: ggml_graph.graph_compute(be.handle, graph),
                    lambda i: None,
                    min_seconds,
                )
    return out


def measure_decode_attention(
    *, threads: int, shapes: Sequence[AttentionShape], rounds: int = ROUNDS, min_seconds: float = 0.03
) -> tuple[AttentionTimes, ...]:
    """One decode token's attention per layer at DECODE_KV, with and without flash attention, for each shape
    (the profile's `decode_attention`): each point the least of `rounds` timings, taken in turn (a busy
    machine only slows a timing down)."""
    out = []
    for shape in dict.fromkeys(shapes):
        best = {flash: dict.fromkeys(DECODE_KV, math.inf) for flash in (True, False)}
        for _ in range(rounds):
            for flash, times in best.items():
                t = time_attention(shape, DECODE_KV, threads=threads, flash=flash, min_seconds=min_seconds)
                for n in DECODE_KV:
                    times[n] = min(times[n], t[n])
        out.append(
            AttentionTimes(
                n_head=shape.n_head,
                n_head_kv=shape.n_head_kv,
                head_dim=shape.head_dim,
                n_kv=DECODE_KV,
                flash_s=tuple(best[True][n] for n in DECODE_KV),
                plain_s=tuple(best[False][n] for n in DECODE_KV),
            )
        )
    return tuple(out)


def describe(times: AttentionTimes) -> str:
    """One line: the measured shape's decode attention per layer at each KV length, flash / without."""
    points = ", ".join(
        f"{n}: {f * 1e6:.0f}/{p * 1e6:.0f}"
        for n, f, p in zip(times.n_kv, times.flash_s, times.plain_s, strict=True)
    )
    return (
        f"decode attention per layer, {times.n_head} heads ({times.n_head_kv} KV) of {times.head_dim}, us with/without "
        f"flash attention by KV length: {points}"
    )
