"""ggml contexts, tensors, graphs, buffers and backends through ctypes: the bindings of
edgemoe.perf.measure.microbench's microbenchmarks, beside it (the runtime never builds ggml graphs itself)."""

from __future__ import annotations

import ctypes
from typing import Any

from ...errors import NativeLibraryError
from ...runtime.native.ggml import GGML_BACKEND_DEVICE_TYPE_CPU, device_by_type, device_name, reg_proc_address
from ...runtime.native.ggml import cpu_buffer_type as _cpu_buffer_type
from ...runtime.native.loader import GgmlDevice, declare, ggml_base_lib, ggml_cpu_lib, require_ggml_functions
from ...runtime.native.structs import GgmlInitParams, ThreadpoolParams

# enum ggml_status
GGML_STATUS_SUCCESS = 0


_vp, _sz, _i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
# struct ggml_context * ggml_init(struct ggml_init_params params);
_ggml_init = declare("ggml_init", [GgmlInitParams], _vp, ggml_base_lib)
# void ggml_free(struct ggml_context * ctx);
_ggml_free = declare("ggml_free", [_vp], None, ggml_base_lib)
# size_t ggml_tensor_overhead(void);
_tensor_overhead = declare("ggml_tensor_overhead", [], _sz, ggml_base_lib)
# size_t ggml_graph_overhead_custom(size_t size, bool grads);
_graph_overhead_custom = declare("ggml_graph_overhead_custom", [_sz, ctypes.c_bool], _sz, ggml_base_lib)
# struct ggml_tensor * ggml_new_tensor(struct ggml_context * ctx, enum ggml_type type, int n_dims,
#                                      const int64_t * ne);
_new_tensor = declare(
    "ggml_new_tensor", [_vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_i64)], _vp, ggml_base_lib
)
# size_t ggml_nbytes(const struct ggml_tensor * tensor);
_nbytes = declare("ggml_nbytes", [_vp], _sz, ggml_base_lib)
# const char * ggml_get_name(const struct ggml_tensor * tensor);
_get_name = declare("ggml_get_name", [_vp], ctypes.c_char_p, ggml_base_lib)
# int64_t ggml_blck_size(enum ggml_type type);
_blck_size = declare("ggml_blck_size", [ctypes.c_int], _i64, ggml_base_lib)
# size_t ggml_row_size(enum ggml_type type, int64_t ne);
_row_size = declare("ggml_row_size", [ctypes.c_int, _i64], _sz, ggml_base_lib)
# bool ggml_quantize_requires_imatrix(enum ggml_type type);
_quantize_requires_imatrix = declare(
    "ggml_quantize_requires_imatrix", [ctypes.c_int], ctypes.c_bool, ggml_base_lib
)
# size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows,
#                            int64_t n_per_row, const float * imatrix);
_quantize_chunk = declare(
    "ggml_quantize_chunk", [ctypes.c_int, _vp, _vp, _i64, _i64, _i64, _vp], _sz, ggml_base_lib
)
# struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a,
#                                   struct ggml_tensor * b);
_mul_mat = declare("ggml_mul_mat", [_vp, _vp, _vp], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * as,
#                                      struct ggml_tensor * b, struct ggml_tensor * ids);
_mul_mat_id = declare("ggml_mul_mat_id", [_vp, _vp, _vp, _vp], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_swiglu_split(struct ggml_context * ctx, struct ggml_tensor * a,
#                                        struct ggml_tensor * b);
_swiglu_split = declare("ggml_swiglu_split", [_vp, _vp, _vp], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
_add = declare("ggml_add", [_vp, _vp, _vp], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
_scale = declare("ggml_scale", [_vp, _vp, ctypes.c_float], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1,
#                                  int axis2, int axis3);
_permute = declare(
    "ggml_permute", [_vp, _vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int], _vp, ggml_base_lib
)
# struct ggml_tensor * ggml_cont(struct ggml_context * ctx, struct ggml_tensor * a);
_cont = declare("ggml_cont", [_vp, _vp], _vp, ggml_base_lib)
# struct ggml_tensor * ggml_soft_max_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask,
#                                       float scale, float max_bias);
_soft_max_ext = declare(
    "ggml_soft_max_ext", [_vp, _vp, _vp, ctypes.c_float, ctypes.c_float], _vp, ggml_base_lib
)
# struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
#                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale,
#                                         float max_bias, float logit_softcap);
_flash_attn_ext = declare(
    "ggml_flash_attn_ext",
    [_vp, _vp, _vp, _vp, _vp, ctypes.c_float, ctypes.c_float, ctypes.c_float],
    _vp,
    ggml_base_lib,
)
# struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
_new_graph_custom = declare("ggml_new_graph_custom", [_vp, _sz, ctypes.c_bool], _vp, ggml_base_lib)
# void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
_build_forward_expand = declare("ggml_build_forward_expand", [_vp, _vp], None, ggml_base_lib)
# int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
_graph_n_nodes = declare("ggml_graph_n_nodes", [_vp], ctypes.c_int, ggml_base_lib)

# ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
#                                                                ggml_backend_buffer_type_t buft);
_alloc_ctx_tensors_from_buft = declare(
    "ggml_backend_alloc_ctx_tensors_from_buft", [_vp, _vp], _vp, ggml_base_lib
)
# ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
_buft_alloc_buffer = declare("ggml_backend_buft_alloc_buffer", [_vp, _sz], _vp, ggml_base_lib)
# const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
_buft_name = declare("ggml_backend_buft_name", [_vp], ctypes.c_char_p, ggml_base_lib)
# bool ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);
_buft_is_host = declare("ggml_backend_buft_is_host", [_vp], ctypes.c_bool, ggml_base_lib)
# void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
_buffer_free = declare("ggml_backend_buffer_free", [_vp], None, ggml_base_lib)
# void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
_buffer_clear = declare("ggml_backend_buffer_clear", [_vp, ctypes.c_uint8], None, ggml_base_lib)
# void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
_buffer_get_base = declare("ggml_backend_buffer_get_base", [_vp], _vp, ggml_base_lib)
# enum ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor,
#                                            void * addr);
_tensor_alloc = declare("ggml_backend_tensor_alloc", [_vp, _vp, _vp], ctypes.c_int, ggml_base_lib)
# void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
_tensor_set = declare("ggml_backend_tensor_set", [_vp, _vp, _sz, _sz], None, ggml_base_lib)
# void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
_tensor_get = declare("ggml_backend_tensor_get", [_vp, _vp, _sz, _sz], None, ggml_base_lib)
# void ggml_backend_tensor_set_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data,
#                                    size_t offset, size_t size);
_tensor_set_async = declare("ggml_backend_tensor_set_async", [_vp, _vp, _vp, _sz, _sz], None, ggml_base_lib)

# void ggml_backend_free(ggml_backend_t backend);
_backend_free = declare("ggml_backend_free", [_vp], None, ggml_base_lib)
# const char * ggml_backend_name(ggml_backend_t backend);
_backend_name = declare("ggml_backend_name", [_vp], ctypes.c_char_p, ggml_base_lib)
# ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
_backend_default_buft = declare("ggml_backend_get_default_buffer_type", [_vp], _vp, ggml_base_lib)
# enum ggml_status ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
_graph_compute = declare("ggml_backend_graph_compute", [_vp, _vp], ctypes.c_int, ggml_base_lib)
# struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);
_graph_node = declare("ggml_graph_node", [_vp, ctypes.c_int], _vp, ggml_base_lib)
# void ggml_backend_synchronize(ggml_backend_t backend);
_backend_synchronize = declare("ggml_backend_synchronize", [_vp], None, ggml_base_lib)
# ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
_dev_init = declare("ggml_backend_dev_init", [_vp, ctypes.c_char_p], _vp, ggml_base_lib)
# enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
_dev_type = declare("ggml_backend_dev_type", [_vp], ctypes.c_int, ggml_base_lib)
# ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
_dev_backend_reg = declare("ggml_backend_dev_backend_reg", [_vp], _vp, ggml_base_lib)
# ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
_dev_buft = declare("ggml_backend_dev_buffer_type", [_vp], _vp, ggml_base_lib)
# ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device);
_dev_host_buft = declare("ggml_backend_dev_host_buffer_type", [_vp], _vp, ggml_base_lib)
# bool ggml_backend_dev_supports_op(ggml_backend_dev_t device, const struct ggml_tensor * op);
_dev_supports_op = declare("ggml_backend_dev_supports_op", [_vp, _vp], ctypes.c_bool, ggml_base_lib)
# typedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device);
_GetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(_vp), _vp)

# ggml_backend_t ggml_backend_cpu_init(void);
_cpu_init = declare("ggml_backend_cpu_init", [], _vp, ggml_cpu_lib)
# void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
_cpu_set_n_threads = declare("ggml_backend_cpu_set_n_threads", [_vp, ctypes.c_int], None, ggml_cpu_lib)
# void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, ggml_threadpool_t threadpool);
_cpu_set_threadpool = declare("ggml_backend_cpu_set_threadpool", [_vp, _vp], None, ggml_cpu_lib)
# void ggml_threadpool_params_init(struct ggml_threadpool_params * p, int n_threads);
_threadpool_params_init = declare(
    "ggml_threadpool_params_init", [ctypes.POINTER(ThreadpoolParams), ctypes.c_int], None, ggml_base_lib
)
# struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
_threadpool_new = declare("ggml_threadpool_new", [ctypes.POINTER(ThreadpoolParams)], _vp, ggml_cpu_lib)
# void ggml_threadpool_free(struct ggml_threadpool * threadpool);
_threadpool_free = declare("ggml_threadpool_free", [_vp], None, ggml_cpu_lib)


def _require(*fns: Any) -> None:
    require_ggml_functions(*fns, caller="edgemoe's microbenchmarks")


def require_ggml() -> None:
    """Raise NativeLibraryError unless every ggml function the microbenchmarks call was found."""
    _require(
        _ggml_init,
        _ggml_free,
        _tensor_overhead,
        _graph_overhead_custom,
        _new_tensor,
        _nbytes,
        _get_name,
        _blck_size,
        _row_size,
        _quantize_requires_imatrix,
        _quantize_chunk,
        _mul_mat,
        _mul_mat_id,
        _swiglu_split,
        _add,
        _scale,
        _permute,
        _cont,
        _soft_max_ext,
        _flash_attn_ext,
        _new_graph_custom,
        _build_forward_expand,
        _graph_n_nodes,
        _alloc_ctx_tensors_from_buft,
        _buft_alloc_buffer,
        _buft_name,
        _buft_is_host,
        _buffer_free,
        _buffer_clear,
        _buffer_get_base,
        _tensor_alloc,
        _tensor_set,
        _tensor_get,
        _tensor_set_async,
        _backend_free,
        _backend_name,
        _backend_default_buft,
        _graph_compute,
        _graph_node,
        _backend_synchronize,
        _dev_init,
        _dev_type,
        _dev_backend_reg,
        _dev_buft,
        _dev_host_buft,
        _dev_supports_op,
        _cpu_init,
        _cpu_set_n_threads,
        _cpu_set_threadpool,
        _threadpool_params_init,
        _threadpool_new,
        _threadpool_free,
    )


def _ptr(value: int | None, what: str) -> int:
    if not value:
        raise NativeLibraryError(f"{what} returned NULL (out of memory, or a ggml build without it)")
    return int(value)


def ggml_context(n_tensors: int, graph_size: int = 0) -> int:
    """A ggml context (no_alloc: tensor data lives in backend buffers) with room for n_tensors tensor
    headers and, when graph_size > 0, one graph of that many nodes. Free it with ggml_context_free."""
    _require(_ggml_init, _tensor_overhead, _graph_overhead_custom)
    size = _tensor_overhead() * max(n_tensors, 1) + 1024
    if graph_size > 0:
        size += _graph_overhead_custom(graph_size, False)
    return _ptr(_ggml_init(GgmlInitParams(size, None, True)), "ggml_init")


def ggml_context_free(ctx: int) -> None:
    _ggml_free(ctx)


def ggml_new_tensor(ctx: int, type_id: int, shape: tuple[int, ...] | list[int]) -> int:
    """A tensor of ggml type type_id and shape (ggml order: shape[0] is the contiguous dimension)."""
    ne = (_i64 * len(shape))(*shape)
    return _ptr(_new_tensor(ctx, type_id, len(shape), ne), "ggml_new_tensor")


def ggml_nbytes(tensor: int) -> int:
    return int(_nbytes(tensor))


def ggml_get_name(tensor: int) -> str:
    return _get_name(tensor).decode()


def ggml_block_size(type_id: int) -> int:
    return int(_blck_size(type_id))


def ggml_row_size(type_id: int, n: int) -> int:
    """Bytes of a row of n elements of the type."""
    return int(_row_size(type_id, n))


def ggml_quantize_requires_imatrix(type_id: int) -> bool:
    return bool(_quantize_requires_imatrix(type_id))


def ggml_quantize_rows(
    type_id: int, src: int, dst: int, n_rows: int, n_per_row: int, imatrix: int | None = None
) -> int:
    """Quantize n_rows float rows at address src into dst (imatrix: the address of n_per_row float
    importances, needed by the types ggml_quantize_requires_imatrix names); bytes written."""
    _require(_quantize_chunk)
    return int(_quantize_chunk(type_id, src, dst, 0, n_rows, n_per_row, imatrix))


def ggml_mul_mat(ctx: int, a: int, b: int) -> int:
    return _ptr(_mul_mat(ctx, a, b), "ggml_mul_mat")


def ggml_mul_mat_id(ctx: int, stacked: int, b: int, ids: int) -> int:
    return _ptr(_mul_mat_id(ctx, stacked, b, ids), "ggml_mul_mat_id")


def ggml_swiglu_split(ctx: int, gate: int, up: int) -> int:
    """silu(gate) * up."""
    return _ptr(_swiglu_split(ctx, gate, up), "ggml_swiglu_split")


def ggml_add(ctx: int, a: int, b: int) -> int:
    return _ptr(_add(ctx, a, b), "ggml_add")


def ggml_scale(ctx: int, a: int, s: float) -> int:
    return _ptr(_scale(ctx, a, s), "ggml_scale")


def ggml_permute(ctx: int, a: int, axes: tuple[int, int, int, int]) -> int:
    """A view of a with its dimension i moved to axes[i]."""
    return _ptr(_permute(ctx, a, *axes), "ggml_permute")


def ggml_cont(ctx: int, a: int) -> int:
    """A contiguous copy of a (a permuted view)."""
    return _ptr(_cont(ctx, a), "ggml_cont")


def ggml_soft_max_ext(ctx: int, a: int, mask: int, scale: float) -> int:
    """softmax(a * scale + mask) over rows (no ALiBi)."""
    return _ptr(_soft_max_ext(ctx, a, mask, scale, 0.0), "ggml_soft_max_ext")


def ggml_flash_attn_ext(ctx: int, q: int, k: int, v: int, mask: int, scale: float) -> int:
    """Fused attention (no ALiBi, no logit soft-capping): q [d, tokens, heads], k and v [d, n_kv, kv_heads]
    (F16), mask [n_kv, tokens] F16; the result is [d, heads, tokens]."""
    return _ptr(_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0, 0.0), "ggml_flash_attn_ext")


def ggml_graph(ctx: int, outputs: list[int], size: int) -> int:
    """A graph of room `size` computing `outputs` (and what they need) in order."""
    graph = _ptr(_new_graph_custom(ctx, size, False), "ggml_new_graph_custom")
    for t in outputs:
        _build_forward_expand(graph, t)
    return graph


def ggml_graph_n_nodes(graph: int) -> int:
    return int(_graph_n_nodes(graph))


def alloc_ctx_tensors(ctx: int, buft: int) -> int:
    """One buffer of type buft holding every not yet allocated tensor of ctx; free it with buffer_free."""
    _require(_alloc_ctx_tensors_from_buft)
    return _ptr(_alloc_ctx_tensors_from_buft(ctx, buft), f"allocating tensors in {buft_name(buft)}")


def buft_alloc_buffer(buft: int, size: int) -> int:
    return _ptr(_buft_alloc_buffer(buft, size), f"allocating {size} bytes in {buft_name(buft)}")


def buft_name(buft: int) -> str:
    return _buft_name(buft).decode() if buft else "?"


def buft_is_host(buft: int) -> bool:
    return bool(_buft_is_host(buft))


def buffer_free(buffer: int | None) -> None:
    if buffer:
        _buffer_free(buffer)


def buffer_clear(buffer: int, value: int) -> None:
    """Set every byte of the buffer to value."""
    _buffer_clear(buffer, value)


def buffer_base(buffer: int) -> int:
    return int(_buffer_get_base(buffer) or 0)


def tensor_alloc(buffer: int, tensor: int, addr: int) -> None:
    """Place an unallocated tensor at addr inside buffer (several tensors may share an address)."""
    status = _tensor_alloc(buffer, tensor, addr)
    if status != GGML_STATUS_SUCCESS:
        raise NativeLibraryError(f"ggml_backend_tensor_alloc failed (status {status})")


def tensor_set(tensor: int, src: int, offset: int, size: int) -> None:
    """Copy size bytes from host address src into the tensor (a repack buffer repacks them here)."""
    _tensor_set(tensor, src, offset, size)


def tensor_get(tensor: int, dst: int, offset: int, size: int) -> None:
    _tensor_get(tensor, dst, offset, size)


def tensor_set_async(backend: int, tensor: int, src: int, offset: int, size: int) -> None:
    """Queue a copy of size bytes from host address src into the tensor on backend's stream (src must stay
    valid until backend_synchronize; backends without async copies copy at once)."""
    _tensor_set_async(backend, tensor, src, offset, size)


def cpu_device() -> int:
    """The CPU device (a ggml_backend_dev_t)."""
    return _ptr(device_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), "ggml_backend_dev_by_type(CPU)")


def device_type(dev: int) -> int:
    """enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU, _GPU, 2 ACCEL, 3 IGPU."""
    return int(_dev_type(dev))


def device_buffer_type(dev: int) -> int:
    return _ptr(_dev_buft(dev), "ggml_backend_dev_buffer_type")


def device_host_buffer_type(dev: int) -> int | None:
    """The device's pinned host buffer type, None when it has none."""
    buft = _dev_host_buft(dev)
    return int(buft) if buft else None


def device_supports_op(dev: int, op: int) -> bool:
    """Whether the device computes op with its sources where they are (an extra buffer type of the CPU
    answers for the weights it holds: the repack one only takes the types and shapes it repacks)."""
    return bool(_dev_supports_op(dev, op))


def cpu_extra_buffer_types() -> list[int]:
    """The CPU backend's extra buffer types (CPU_REPACK, AMX, ...), as llama.cpp's make_cpu_buft_list
    finds them: ggml_backend_dev_get_extra_bufts from the CPU registry."""
    dev = cpu_device()
    proc = reg_proc_address(_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return []
    arr = _GetExtraBufts(proc)(dev)
    out: list[int] = []
    i = 0
    while arr and arr[i]:
        out.append(int(arr[i]))
        i += 1
    return out


def cpu_buffer_type() -> int:
    return _ptr(_cpu_buffer_type(), "ggml_backend_cpu_buffer_type")


def cpu_backend(n_threads: int) -> int:
    """The CPU backend computing with n_threads threads; free it with backend_free."""
    _require(_cpu_init, _cpu_set_n_threads)
    backend = _ptr(_cpu_init(), "ggml_backend_cpu_init")
    _cpu_set_n_threads(backend, n_threads)
    return backend


def threadpool_new(n_threads: int) -> int:
    """A persistent ggml threadpool of n_threads (default priority and polling); free with threadpool_free."""
    _require(_threadpool_params_init, _threadpool_new)
    params = ThreadpoolParams()
    _threadpool_params_init(ctypes.byref(params), n_threads)
    return _ptr(_threadpool_new(ctypes.byref(params)), "ggml_threadpool_new")


def threadpool_free(threadpool: int | None) -> None:
    if threadpool:
        _threadpool_free(threadpool)


def cpu_set_threadpool(backend: int, threadpool: int | None) -> None:
    """Compute the CPU backend's graphs on threadpool (None: a pool made and joined per graph)."""
    _cpu_set_threadpool(backend, threadpool)


def device_backend(dev: int) -> int:
    """A backend on device (ggml_backend_dev_init); free it with backend_free."""
    return _ptr(_dev_init(dev, None), f"ggml_backend_dev_init({device_name(GgmlDevice(dev))})")


def backend_free(backend: int | None) -> None:
    if backend:
        _backend_free(backend)


def backend_name(backend: int) -> str:
    return _backend_name(backend).decode()


def backend_default_buffer_type(backend: int) -> int:
    return _ptr(_backend_default_buft(backend), "ggml_backend_get_default_buffer_type")


def graph_compute(backend: int, graph: int) -> None:
    """Compute the graph on the backend and wait for it. ggml_backend_graph_compute only queues the work on
    asynchronous backends (CUDA; RPC, whose synchronize waits for the sends alone): reading 4 bytes of the last
    node back is answered only once the graph has run."""
    status = _graph_compute(backend, graph)
    if status != GGML_STATUS_SUCCESS:
        raise NativeLibraryError(
            f"ggml_backend_graph_compute on {backend_name(backend)} failed (status {status})"
        )
    _backend_synchronize(backend)
    probe = ctypes.c_float()
    _tensor_get(_graph_node(graph, -1), ctypes.byref(probe), 0, 4)


def backend_synchronize(backend: int) -> None:
    _backend_synchronize(backend)
