"""Machine microbenchmarks through ggml, the numbers `edgemoe profile` fits its cost model to.

Each function builds a small ggml graph of the ops llama.cpp runs (weights in the buffer type
llama.cpp's default load would give them, activations F32), computes it many times on a backend
(the CPU with a thread count, or any ggml device) and returns seconds per call: the median of
individually timed ``ggml_backend_graph_compute`` calls, at least ``min_seconds`` of them per point.
Everything a call allocates (contexts, buffers, backends, its threadpool) is freed before it returns.

On the CPU the graphs run on a ggml threadpool held for the whole call, so no figure includes a thread
start (llama.cpp pays that once per whole-model graph, if at all: in an OpenMP build, as `make install`
makes, OpenMP's persistent threads do the work with or without the threadpool, and the figures agree).
The ctypes declarations are in edgemoe.runtime.native and, for ggml graphs, edgemoe.perf.ggml_graph.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from ...errors import EdgeMoeError
from ...runtime import native
from . import ggml_graph

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

log = logging.getLogger(__name__)

# the weight types these benchmarks build (quantized from a few random rows, then tiled); the first
# IQ1_*/IQ2_* weights of a process wait seconds for ggml to build its quantization grids
QTYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q6_K",
    "Q5_K",
    "Q5_1",
    "Q5_0",
    "Q4_K",
    "Q4_1",
    "Q4_0",
    "MXFP4",
    "IQ4_XS",
    "IQ4_NL",
    "Q3_K",
    "IQ3_S",
    "IQ3_XXS",
    "Q2_K",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ1_M",
    "IQ1_S",
)
POOL_CAP_BYTES = 1 << 30  # cold pools stop here, whatever the cache
MAX_POOL = 4096  # weight sets in a cold pool (each a tensor and, for matmuls, a graph)
_FALLBACK_LLC_BYTES = 32 << 20  # when sysfs does not say
_PROBE_TOKENS = 512  # llama.cpp asks the buffer type about a 512-token batch (weight_buft_supported)
_MIN_CALLS = 5
_MAX_CALLS = 20000
_TILE_ROWS = 8  # distinct quantized rows tiled over a weight


class KernelTimings(dict[int, float]):
    """Seconds per call for each token count, plus where they were measured.

    buffer_type: the weights' buffer type ("CPU_REPACK", "CPU", "CUDA0", "RPC[...]");
    backend: the backend that computed; pool: weight sets (experts or matrices) rotated over (1: hot);
    pool_bytes: their bytes in all.
    """

    buffer_type: str
    backend: str
    pool: int
    pool_bytes: int

    def __init__(
        self, values: dict[int, float], *, buffer_type: str, backend: str, pool: int, pool_bytes: int
    ) -> None:
        super().__init__(values)
        self.buffer_type, self.backend, self.pool, self.pool_bytes = buffer_type, backend, pool, pool_bytes

    def __repr__(self) -> str:
        return (
            f"KernelTimings({dict.__repr__(self)}, buffer_type={self.buffer_type!r}, backend={self.backend!r}, "
            f"pool={self.pool}, pool_bytes={self.pool_bytes})"
        )


def quant_types_supported() -> list[str]:
    """The weight type names time_expert_ffn and time_matmul accept."""
    return list(QTYPES)


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0 (sysfs cache/index*/size), 32 MiB when sysfs does not say."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or _FALLBACK_LLC_BYTES


# -- argument checks --------------------------------------------------------------------------------------


def _type_id(qtype: str) -> int:
    name = qtype.upper()
    if name not in QTYPES:
        raise EdgeMoeError(f"unknown weight type {qtype!r}: use one of {' '.join(QTYPES)}")
    return native.GGML_TYPES[name]


def _check_dims(qtype: str, type_id: int, rows: dict[str, int], other: dict[str, int]) -> None:
    """rows: dimensions that are some weight's row length (a whole number of the type's blocks)."""
    for what, n in {**rows, **other}.items():
        if n < 1:
            raise EdgeMoeError(f"{what}={n}: dimensions must be positive")
    block = ggml_graph.ggml_block_size(type_id)
    for what, n in rows.items():
        if n % block:
            raise EdgeMoeError(
                f"{what}={n} is not a multiple of {qtype}'s block of {block} values (the "
                f"length of a {qtype} weight row): pick a multiple of {block} or another type"
            )


def _check_counts(token_counts: Sequence[int]) -> list[int]:
    counts = sorted({int(c) for c in token_counts})
    if not counts or counts[0] < 1:
        raise EdgeMoeError(f"token counts {list(token_counts)}: give one or more counts >= 1")
    return counts


def _check_threads(threads: int) -> None:
    if not 1 <= threads <= 512:
        raise EdgeMoeError(f"threads={threads}: use 1..512 (ggml's GGML_MAX_N_THREADS)")


# -- backends, weights and timing ---------------------------------------------------------------------------


@dataclass
class Backend:
    handle: int
    compute_buft: int  # activations and results
    weight_buft: int  # the plain buffer type for weights on this backend
    device: int  # the ggml_backend_dev_t
    is_cpu: bool
    name: str


@contextmanager
def open_backend(threads: int, device: int | None) -> Iterator[Backend]:
    ggml_graph.require_ggml()
    cpu = ggml_graph.cpu_device()
    with ExitStack() as stack:
        if device is None or device == cpu:
            _check_threads(threads)
            backend = ggml_graph.cpu_backend(threads)
            stack.callback(ggml_graph.backend_free, backend)
            pool = ggml_graph.threadpool_new(threads)
            stack.callback(ggml_graph.threadpool_free, pool)
            ggml_graph.cpu_set_threadpool(backend, pool)
            stack.callback(ggml_graph.cpu_set_threadpool, backend, None)  # runs before the pool is freed
            buft = ggml_graph.cpu_buffer_type()
            yield Backend(backend, buft, buft, cpu, True, ggml_graph.backend_name(backend))
        else:
            backend = ggml_graph.device_backend(device)
            stack.callback(ggml_graph.backend_free, backend)
            yield Backend(
                backend,
                ggml_graph.backend_default_buffer_type(backend),
                ggml_graph.device_buffer_type(device),
                device,
                False,
                ggml_graph.backend_name(backend),
            )


def _repack_buft() -> int | None:
    """The CPU's repack extra buffer type, as llama.cpp's make_cpu_buft_list finds it; None without one."""
    for buft in ggml_graph.cpu_extra_buffer_types():
        if "REPACK" in ggml_graph.buft_name(buft).upper():
            return buft
    return None


def _fill_weight_rows(out: np.ndarray, type_id: int, n_per_row: int, n_rows: int, seed: int) -> np.ndarray:
    """Write n_rows rows of the type's bytes into the start of out (a uint8 array) and return that part:
    a few random rows (N(0, 0.02)) quantized with ggml and tiled, so every block has finite scales."""
    rng = np.random.default_rng(seed)
    k = math.gcd(n_rows, _TILE_ROWS)
    src = (rng.standard_normal((k, n_per_row)) * 0.02).astype(np.float32)
    if type_id == native.GGML_TYPES["F32"]:
        block = src.view(np.uint8).reshape(-1)
    elif type_id == native.GGML_TYPES["F16"]:
        block = src.astype(np.float16).view(np.uint8).reshape(-1)
    else:
        block = np.empty(k * ggml_graph.ggml_row_size(type_id, n_per_row), np.uint8)
        imatrix = np.ones(n_per_row, np.float32)  # for the types that cannot do without one
        imatrix_ptr = imatrix.ctypes.data if ggml_graph.ggml_quantize_requires_imatrix(type_id) else None
        ggml_graph.ggml_quantize_rows(type_id, src.ctypes.data, block.ctypes.data, k, n_per_row, imatrix_ptr)
    part = out[: (n_rows // k) * block.size]
    part.reshape(n_rows // k, block.size)[:] = block  # broadcast: as fast as the pages can be written
    return part


@dataclass
class _Weights:
    tensors: list[int]
    buft: int
    nbytes: int


def _make_weights(
    stack: ExitStack,
    be: Backend,
    type_id: int,
    shapes: list[tuple[int, ...]],
    *,
    repack: bool,
    probe: Callable[[int, int, tuple[int, ...]], int],
) -> _Weights:
    """Weight tensors of the shapes in one buffer: the CPU's repack buffer type when asked for and it takes
    every one of them (probe(ctx, w, shape) builds the op llama.cpp asks it about), else the backend's
    plain one. Contents set with ggml_backend_tensor_set (where the repack happens)."""

    def allocate(buft: int) -> tuple[int, list[int], int]:
        ctx = ggml_graph.ggml_context(len(shapes))
        try:
            tensors = [ggml_graph.ggml_new_tensor(ctx, type_id, shape) for shape in shapes]
            return ctx, tensors, ggml_graph.alloc_ctx_tensors(ctx, buft)
        except BaseException:
            ggml_graph.ggml_context_free(ctx)
            raise

    chosen = None
    if repack and be.is_cpu and (rb := _repack_buft()) is not None:
        ctx, tensors, buffer = allocate(rb)
        pctx = ggml_graph.ggml_context(8 * len(tensors))
        try:
            ok = all(
                ggml_graph.device_supports_op(be.device, probe(pctx, w, shape))
                for w, shape in zip(tensors, shapes, strict=False)
            )
        finally:
            ggml_graph.ggml_context_free(pctx)
        if ok:
            chosen = (ctx, tensors, buffer, rb)
        else:
            ggml_graph.buffer_free(buffer)
            ggml_graph.ggml_context_free(ctx)
    if chosen is None:
        ctx, tensors, buffer = allocate(be.weight_buft)
        chosen = (ctx, tensors, buffer, be.weight_buft)
    ctx, tensors, buffer, buft = chosen
    stack.callback(ggml_graph.ggml_context_free, ctx)
    stack.callback(ggml_graph.buffer_free, buffer)
    total = 0
    staging = np.empty(max(ggml_graph.ggml_nbytes(w) for w in tensors), np.uint8)  # one host copy, refilled
    filled: tuple[int, int] | None = None
    data = staging[:0]
    for w, shape in zip(tensors, shapes, strict=False):
        key = (shape[0], math.prod(shape[1:]))
        if key != filled:  # gate and up (and a pool of matrices) share the contents
            data = _fill_weight_rows(staging, type_id, key[0], key[1], seed=key[0])
            filled = key
        if data.nbytes != ggml_graph.ggml_nbytes(w):
            raise AssertionError(f"{data.nbytes} bytes staged for a tensor of {ggml_graph.ggml_nbytes(w)}")
        ggml_graph.tensor_set(w, data.ctypes.data, 0, data.nbytes)  # whole tensors: repack takes nothing less
        total += data.nbytes
    return _Weights(tensors, buft, total)


def _pool_size(item_bytes: int, cold: bool, be: Backend, pool_bytes: int | None) -> int:
    """Weight sets to rotate over: 1 hot; cold, enough that their bytes reach pool_bytes (None: twice the
    last-level cache, but not above POOL_CAP_BYTES nor a quarter of a device's free memory), at least 2
    and at most MAX_POOL."""
    if not cold:
        return 1
    if pool_bytes is not None:
        return max(2, min(math.ceil(pool_bytes / item_bytes), MAX_POOL))
    cap = POOL_CAP_BYTES
    if not be.is_cpu:
        free, _total = native.device_memory(native.GgmlDevice(be.device))
        if free > 0:
            cap = min(cap, free // 4)
    n = min(math.ceil(2 * last_level_cache_bytes() / item_bytes), cap // item_bytes)
    return max(2, min(n, MAX_POOL))


def median_call(compute: Callable[[], None], prepare: Callable[[int], None], min_seconds: float) -> float:
    """The median of timed compute() calls, each after an untimed prepare(i); one warm-up call first;
    at least _MIN_CALLS calls and min_seconds of calls."""
    prepare(0)
    compute()
    times: list[float] = []
    spent = 0.0
    i = 1
    while (len(times) < _MIN_CALLS or spent < min_seconds) and len(times) < _MAX_CALLS:
        prepare(i)
        t0 = time.perf_counter()
        compute()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        i += 1
    return statistics.median(times)


def _f32(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32)


# -- the benchmarks -------------------------------------------------------------------------------------


def _mul_mat_id_probe(ctx: int, w: int, shape: tuple[int, ...]) -> int:
    """llama.cpp's weight_buft_supported test for MUL_MAT_ID: [ne0, 1, 512] activations, ids [1, 512]."""
    x = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (shape[0], 1, _PROBE_TOKENS))
    ids = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_I32, (1, _PROBE_TOKENS))
    return ggml_graph.ggml_mul_mat_id(ctx, w, x, ids)


def _mul_mat_probe(ctx: int, w: int, shape: tuple[int, ...]) -> int:
    """llama.cpp's weight_buft_supported test for MUL_MAT: [ne0, 512] activations."""
    x = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (shape[0], _PROBE_TOKENS))
    return ggml_graph.ggml_mul_mat(ctx, w, x)


class TimerOptions(TypedDict, total=False):
    """How time_expert_ffn and time_matmul time their products (typed keywords; the default in brackets)."""

    # on the CPU, weights in the CPU backend's repack buffer type when it takes the type and shape (llama.cpp's
    # default load), else the plain CPU buffer; False: always the plain one [True]
    repack: bool
    # each call reads its weights from memory (DRAM; device memory on a device): the calls rotate over a pool of
    # weights of twice the last-level cache (capped at 1 GiB, MAX_POOL weights; pool_bytes overrides it); False:
    # always the same weights, which stay in cache after the warm-up call [True]
    cold: bool
    # a ggml_backend_dev_t whose backend computes the graph (a CUDA GPU, the RPC loopback device of
    # native.rpc_loopback_device); threads is then not used [None: the CPU backend with `threads` threads]
    device: int | None
    min_seconds: float  # of timed calls per point, at least 5 of them [0.05]
    pool_bytes: int | None  # the cold pool's bytes [None: as `cold` says]


@dataclass(frozen=True)
class _Product:
    """What one timer builds: the weight tensors of a pool of n, llama.cpp's buffer-type test for them, and the
    median seconds at c tokens."""

    name: str  # for the log
    item_bytes: int  # one weight set of the pool
    shapes: Callable[[int], list[tuple[int, ...]]]
    probe: Callable[[int, int, tuple[int, ...]], int]
    time_at: Callable[[Backend, _Weights, int, int, float], float]  # (backend, weights, pool, c, min_seconds)


def _time_product(
    product: _Product, counts: list[int], type_id: int, threads: int, options: TimerOptions
) -> KernelTimings:
    """The product's seconds at each token count, with the buffer type, backend and pool used."""
    with ExitStack() as stack:
        be = stack.enter_context(open_backend(threads, options.get("device")))
        pool = _pool_size(product.item_bytes, options.get("cold", True), be, options.get("pool_bytes"))
        repack = options.get("repack", True)
        weights = _make_weights(stack, be, type_id, product.shapes(pool), repack=repack, probe=product.probe)
        min_seconds = options.get("min_seconds", 0.05)
        out = {c: product.time_at(be, weights, pool, c, min_seconds) for c in counts}
        result = KernelTimings(
            out,
            buffer_type=ggml_graph.buft_name(weights.buft),
            backend=be.name,
            pool=pool,
            pool_bytes=pool * product.item_bytes,
        )
    log.debug("%s: %r", product.name, result)
    return result


def time_expert_ffn(
    qtype: str,
    n_embd: int,
    n_ff: int,
    token_counts: Sequence[int],
    *,
    threads: int,
    **options: Unpack[TimerOptions],
) -> KernelTimings:
    """Seconds for ONE expert's SwiGLU FFN over c tokens that all route to it, for each c in token_counts.

    Timed: one ggml_backend_graph_compute of ggml_mul_mat_id of the stacked gate [n_embd, n_ff, n_expert]
    and up weights by the F32 activations [n_embd, 1, c] (ids [1, c], every id the same expert),
    ggml_swiglu_split, and ggml_mul_mat_id of the stacked down [n_ff, n_embd, n_expert]: the graph
    llama.cpp builds for a MoE layer, with top-1 routing. Setting the ids between calls is not timed.

    Cold (TimerOptions), the ids rotate over a pool of experts; hot, always expert 0 of 2. Returns
    KernelTimings: {c: seconds} with the buffer type, backend and pool used.
    """
    type_id = _type_id(qtype)
    _check_dims(qtype, type_id, {"n_embd": n_embd, "n_ff": n_ff}, {})
    counts = _check_counts(token_counts)
    expert_bytes = (
        2 * ggml_graph.ggml_row_size(type_id, n_embd) * n_ff
        + ggml_graph.ggml_row_size(type_id, n_ff) * n_embd
    )
    rng = np.random.default_rng(2)

    def shapes(pool: int) -> list[tuple[int, ...]]:
        n_expert = max(pool, 2)  # a stack of one expert is 2-d, and the repack type takes only 3-d ones
        return [(n_embd, n_ff, n_expert), (n_embd, n_ff, n_expert), (n_ff, n_embd, n_expert)]

    def time_at(be: Backend, weights: _Weights, pool: int, c: int, min_seconds: float) -> float:
        order = np.random.default_rng(1).permutation(pool).astype(np.int32)  # [0] when hot
        return _time_ffn_at(be, weights.tensors, n_embd, c, order, rng, min_seconds)

    name = f"expert FFN {qtype} {n_embd}x{n_ff}"
    return _time_product(
        _Product(name, expert_bytes, shapes, _mul_mat_id_probe, time_at), counts, type_id, threads, options
    )


def _time_ffn_at(
    be: Backend,
    tensors: Sequence[int],
    n_embd: int,
    c: int,
    order: np.ndarray,
    rng: np.random.Generator,
    min_seconds: float,
) -> float:
    """time_expert_ffn's median seconds at c tokens: the gate/up/swiglu/down graph over the stacked `tensors`,
    every token to the next expert of `order` at each call."""
    gate, up, down = tensors
    with ExitStack() as per:
        ctx = ggml_graph.ggml_context(8, graph_size=16)
        per.callback(ggml_graph.ggml_context_free, ctx)
        x = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (n_embd, 1, c))
        ids = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_I32, (1, c))
        h = ggml_graph.ggml_swiglu_split(
            ctx,
            ggml_graph.ggml_mul_mat_id(ctx, gate, x, ids),
            ggml_graph.ggml_mul_mat_id(ctx, up, x, ids),
        )
        graph = ggml_graph.ggml_graph(ctx, [ggml_graph.ggml_mul_mat_id(ctx, down, h, ids)], 16)
        per.callback(ggml_graph.buffer_free, ggml_graph.alloc_ctx_tensors(ctx, be.compute_buft))
        xs = _f32(rng, n_embd * c)
        ggml_graph.tensor_set(x, xs.ctypes.data, 0, xs.nbytes)
        row = np.empty(c, np.int32)
        last = [-1]

        def prepare(i: int) -> None:
            expert = int(order[i % len(order)])
            if expert != last[0]:  # every token to the pool's next expert
                row.fill(expert)
                ggml_graph.tensor_set(ids, row.ctypes.data, 0, row.nbytes)
                last[0] = expert

        def compute() -> None:
            ggml_graph.graph_compute(be.handle, graph)

        return median_call(compute, prepare, min_seconds)


def time_matmul(
    qtype: str,
    ne0: int,
    ne1: int,
    token_counts: Sequence[int],
    *,
    threads: int,
    **options: Unpack[TimerOptions],
) -> KernelTimings:
    """Seconds for ggml_mul_mat of a [ne0, ne1] weight (ne0 = input features, ggml order) by [ne0, c] F32
    activations, for each c in token_counts (a dense layer: attention projections, shared experts, output).

    Timed: one ggml_backend_graph_compute of a one-node graph. Cold (TimerOptions), each call multiplies the
    next of a pool of separate weights (one graph per weight, all writing the same result memory); hot, always
    the same weight. Returns KernelTimings: {c: seconds} with the buffer type, backend and pool used.
    """
    type_id = _type_id(qtype)
    _check_dims(qtype, type_id, {"ne0": ne0}, {"ne1": ne1})
    counts = _check_counts(token_counts)
    rng = np.random.default_rng(2)

    def time_at(be: Backend, weights: _Weights, pool: int, c: int, min_seconds: float) -> float:
        order = [weights.tensors[k] for k in np.random.default_rng(1).permutation(pool)]
        return _time_matmul_at(be, order, ne0, c, rng, min_seconds)

    name = f"matmul {qtype} {ne0}x{ne1}"
    w_bytes = ggml_graph.ggml_row_size(type_id, ne0) * ne1
    product = _Product(name, w_bytes, lambda pool: [(ne0, ne1)] * pool, _mul_mat_probe, time_at)
    return _time_product(product, counts, type_id, threads, options)


def _time_matmul_at(
    be: Backend, order: list[int], ne0: int, c: int, rng: np.random.Generator, min_seconds: float
) -> float:
    """time_matmul's median seconds at c tokens: one graph per weight of `order`, each call the next one's."""
    align = 4096
    with ExitStack() as per:
        ctx = ggml_graph.ggml_context(1 + len(order), graph_size=0)
        per.callback(ggml_graph.ggml_context_free, ctx)
        x = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (ne0, c))
        results = [ggml_graph.ggml_mul_mat(ctx, w, x) for w in order]
        r_bytes = ggml_graph.ggml_nbytes(results[0])
        x_off = -(-r_bytes // align) * align
        buf = ggml_graph.buft_alloc_buffer(be.compute_buft, x_off + ggml_graph.ggml_nbytes(x))
        per.callback(ggml_graph.buffer_free, buf)
        base = ggml_graph.buffer_base(buf)  # aligned as the buffer type needs
        for r in results:  # every result in the same place: only the weight changes between calls
            ggml_graph.tensor_alloc(buf, r, base)
        ggml_graph.tensor_alloc(buf, x, base + x_off)
        xs = _f32(rng, ne0 * c)
        ggml_graph.tensor_set(x, xs.ctypes.data, 0, xs.nbytes)
        graphs = []
        for r in results:
            g_ctx = ggml_graph.ggml_context(0, graph_size=4)
            per.callback(ggml_graph.ggml_context_free, g_ctx)
            graphs.append(ggml_graph.ggml_graph(g_ctx, [r], 4))
        current = [graphs[0]]

        def prepare(i: int) -> None:
            current[0] = graphs[i % len(graphs)]

        def compute() -> None:
            ggml_graph.graph_compute(be.handle, current[0])

        return median_call(compute, prepare, min_seconds)


def _chain_graph_seconds(be: Backend, n_nodes: int, stack: ExitStack) -> Callable[[], float]:
    """A graph of n_nodes trivial ops on a 64-element F32 tensor (alternately + 1 and * 0.5); returns a
    function that computes it once and says how long that took."""
    ctx = ggml_graph.ggml_context(n_nodes + 2, graph_size=n_nodes + 8)
    stack.callback(ggml_graph.ggml_context_free, ctx)
    x = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (64,))
    one = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_F32, (64,))
    y = x
    for i in range(n_nodes):
        y = ggml_graph.ggml_add(ctx, y, one) if i % 2 == 0 else ggml_graph.ggml_scale(ctx, y, 0.5)
    graph = ggml_graph.ggml_graph(ctx, [y], n_nodes + 8)
    stack.callback(ggml_graph.buffer_free, ggml_graph.alloc_ctx_tensors(ctx, be.compute_buft))
    ones = np.ones(64, np.float32)
    ggml_graph.tensor_set(x, ones.ctypes.data, 0, ones.nbytes)
    ggml_graph.tensor_set(one, ones.ctypes.data, 0, ones.nbytes)

    def run() -> float:
        t0 = time.perf_counter()
        ggml_graph.graph_compute(be.handle, graph)
        return time.perf_counter() - t0

    return run


@dataclass(frozen=True)
class GraphCosts:
    """What a CPU graph costs besides its ops' work: each extra node's dispatch and barrier (node_s), and a
    one-node graph's compute call (one_node_s: waking the threads, the plan, the node): the latter is in every
    microbenchmark's timing, where a model's graph pays the call once per llama_decode and a node per op."""

    node_s: float
    one_node_s: float


def time_graph_costs(
    *, threads: int, device: int | None = None, n_nodes: int = 256, runs: int = 15, max_seconds: float = 2.0
) -> GraphCosts:
    """node_s: (t(2N) - t(N)) / N for chains of N and 2N trivial ops (ggml_add / ggml_scale on a 64-element
    F32 tensor), t the median of up to `runs` interleaved computes of each (at least 3; no more once
    max_seconds have passed), never above t(2N) / 2N (what it is when noise makes the difference negative);
    one_node_s: t(1), timed in the same turns."""
    if n_nodes < 1 or runs < 1:
        raise EdgeMoeError(f"n_nodes={n_nodes}, runs={runs}: both must be >= 1")
    with ExitStack() as stack:
        be = stack.enter_context(open_backend(threads, device))
        chains = [_chain_graph_seconds(be, n, stack) for n in (1, n_nodes, 2 * n_nodes)]
        for chain in chains:
            chain()
        times: list[list[float]] = [[], [], []]
        start = time.perf_counter()
        while len(times[0]) < max(runs, 3) and (
            len(times[0]) < 3 or time.perf_counter() - start < max_seconds
        ):
            for chain, ts in zip(chains, times, strict=True):
                ts.append(chain())
    one, a, b = (statistics.median(ts) for ts in times)
    per_node = (b - a) / n_nodes
    node_s = per_node if 0 < per_node <= b / (2 * n_nodes) else b / (2 * n_nodes)
    return GraphCosts(node_s=node_s, one_node_s=one)


def time_graph_node(
    *, threads: int, device: int | None = None, n_nodes: int = 256, runs: int = 15, max_seconds: float = 2.0
) -> float:
    """Seconds each extra node costs in a graph (time_graph_costs' node_s): the per-op dispatch and
    thread-barrier cost, without the per-graph cost."""
    return time_graph_costs(
        threads=threads, device=device, n_nodes=n_nodes, runs=runs, max_seconds=max_seconds
    ).node_s


def host_copy_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5) -> float:
    """Bytes/s of a large host memcpy (numpy copyto of nbytes, bytes copied / median seconds; the memory
    traffic is twice that, a read and a write), a proxy for DRAM bandwidth."""
    if nbytes < 1:
        raise EdgeMoeError(f"nbytes={nbytes}: copy at least one byte")
    src = np.ones(nbytes, np.uint8)  # pages touched before timing
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _host_source(stack: ExitStack, device: int, nbytes: int, *, pinned: bool) -> int | None:
    """The address of nbytes of host memory to copy from, freed when `stack` closes: one of the device's host
    buffers (pinned on CUDA; None where it has none) or ordinary numpy memory."""
    if pinned:
        host_buft = ggml_graph.device_host_buffer_type(device)
        if host_buft is None:
            return None
        host = ggml_graph.buft_alloc_buffer(host_buft, nbytes)
        stack.callback(ggml_graph.buffer_free, host)
        ggml_graph.buffer_clear(host, 1)
        return ggml_graph.buffer_base(host)
    arr = np.ones(nbytes, np.uint8)
    stack.callback(lambda: arr)  # holds the array until the copies are done
    return int(arr.ctypes.data)


def h2d_bandwidth(
    device: int, *, pinned: bool, nbytes: int = 64 << 20, min_seconds: float = 0.05
) -> float | None:
    """Bytes/s of ggml_backend_tensor_set of nbytes from host memory into a buffer on `device` (median of
    timed copies, at least 5 and min_seconds of them). pinned=True stages from the device's host buffer
    type (ggml_backend_dev_host_buffer_type: pinned memory on CUDA) and returns None when it has none;
    pinned=False from ordinary (pageable) numpy memory."""
    if nbytes < 1:
        raise EdgeMoeError(f"nbytes={nbytes}: copy at least one byte")
    ggml_graph.require_ggml()
    with ExitStack() as stack:
        src = _host_source(stack, device, nbytes, pinned=pinned)
        if src is None:
            return None
        ctx = ggml_graph.ggml_context(1)
        stack.callback(ggml_graph.ggml_context_free, ctx)
        t = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_I8, (nbytes,))
        stack.callback(
            ggml_graph.buffer_free, ggml_graph.alloc_ctx_tensors(ctx, ggml_graph.device_buffer_type(device))
        )

        def copy() -> None:
            ggml_graph.tensor_set(t, src, 0, nbytes)

        seconds = median_call(copy, lambda i: None, min_seconds)
    return nbytes / seconds


def h2d_load_bandwidth(
    device: int, *, chunk: int = 1 << 20, nbytes: int = 64 << 20, min_seconds: float = 0.05
) -> float:
    """Bytes/s of the expert cache's loader path: nbytes sent as chunk-sized asynchronous copies on a backend
    of the device's own (a copy stream), synchronised once, as llama.cpp's loader sends an expert's chunks.
    The source is one of the device's host buffers when it has them (pinned on CUDA: the loader's staging
    buffers, as the cache's staging does), else ordinary memory. A 4-byte read after the synchronisation makes sure the
    device has the bytes (RPC's synchronize waits for the sends alone)."""
    if chunk < 1 or nbytes < chunk:
        raise EdgeMoeError(f"chunk={chunk}, nbytes={nbytes}: send at least one chunk of at least one byte")
    ggml_graph.require_ggml()
    n_chunks = nbytes // chunk
    with ExitStack() as stack:
        src = _host_source(stack, device, chunk, pinned=True) or _host_source(
            stack, device, chunk, pinned=False
        )
        assert src is not None  # the unpinned source always exists
        backend = ggml_graph.device_backend(device)
        stack.callback(ggml_graph.backend_free, backend)
        ctx = ggml_graph.ggml_context(1)
        stack.callback(ggml_graph.ggml_context_free, ctx)
        t = ggml_graph.ggml_new_tensor(ctx, native.GGML_TYPE_I8, (n_chunks * chunk,))
        stack.callback(
            ggml_graph.buffer_free, ggml_graph.alloc_ctx_tensors(ctx, ggml_graph.device_buffer_type(device))
        )
        probe = np.zeros(4, np.uint8)

        def send() -> None:
            for i in range(n_chunks):
                ggml_graph.tensor_set_async(backend, t, src, i * chunk, chunk)
            ggml_graph.backend_synchronize(backend)
            ggml_graph.tensor_get(t, probe.ctypes.data, 0, 4)

        seconds = median_call(send, lambda i: None, min_seconds)
    return n_chunks * chunk / seconds
