"""Every C struct edgemoe mirrors with ctypes, in one place, each against the size the library reports.

ctypes checks no layout: a mirror that drifts from its C struct reads garbage. The series' llama_moe_* structs and the
upstream structs declared by hand are all here; `llama_edgemoe_struct_size(name)` (the series' first patches) reports
the C sizeof of each, `size_mismatches()` compares them (tests/test_native.py), and `markdown()` writes the list
docs/upgrading-llama.md carries. A new mirror goes into MIRRORS with its C name.
"""

from __future__ import annotations

import ctypes

from .loader import declare

# GGML_MAX_N_THREADS (config.MAX_THREADS): the size of ggml_threadpool_params.cpumask
GGML_MAX_N_THREADS = 512


class MoeRoute(ctypes.Structure):
    """struct llama_moe_route: one MoE layer of one ubatch, after top-k, before the experts run."""

    _fields_ = [
        ("il", ctypes.c_int32),
        ("n_tokens", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("n_embd", ctypes.c_int32),
        ("probs", ctypes.POINTER(ctypes.c_float)),  # [n_tokens][n_expert] or NULL
        ("gate_inp", ctypes.POINTER(ctypes.c_float)),  # [n_tokens][n_embd] or NULL
        ("ids", ctypes.POINTER(ctypes.c_int32)),  # [n_tokens][n_expert_used], editable, -1 drops
        ("weights", ctypes.POINTER(ctypes.c_float)),  # [n_tokens][n_expert_used], editable
        ("weight_rule", ctypes.c_int32),  # enum llama_moe_weight_rule of the layer
        ("weight_scale", ctypes.c_float),  # applied after the rule
    ]


class MoeCacheStats(ctypes.Structure):
    """struct llama_moe_cache_stats: counters since the cache was made or the stats reset."""

    _fields_ = [
        ("hits", ctypes.c_uint64),  # routed slots computed from the cache
        ("misses", ctypes.c_uint64),  # routed slots computed from the model's tensors (layers with a cache)
        ("loads", ctypes.c_uint64),  # experts copied into slots
        ("bytes_loaded", ctypes.c_uint64),
        ("prefetches", ctypes.c_uint64),  # loads queued by llama_moe_cache_prefetch
        ("chunks", ctypes.c_uint64),  # chunks issued (gate/up/down byte ranges)
        ("us_blocked", ctypes.c_uint64),  # host time spent waiting for copies
        ("preempted", ctypes.c_uint64),  # queued or copying loads dropped before completing
        ("us_issue", ctypes.c_uint64),  # host time queueing copies (the CPU stand-in: the copies themselves)
        ("load_waits", ctypes.c_uint64),  # loads the compute stream waited for at a ubatch start
        ("chunks_async", ctypes.c_uint64),  # of the chunks, those the load worker issued
        ("us_worker", ctypes.c_uint64),  # host time the caller waited for the worker to finish a chunk
        ("chunks_staged", ctypes.c_uint64),  # of the chunks, those sent from a staging buffer
        ("routes_async", ctypes.c_uint64),  # ubatches whose routes the worker's policy step processed
        ("waits_timed", ctypes.c_uint64),  # of the load waits, those the worker timed
        (
            "us_load_wait",
            ctypes.c_uint64,
        ),  # their time from the compute's wait to the copies' end: an upper bound
    ]


class MoeStats(ctypes.Structure):
    """struct llama_moe_stats: what the MoE control path did since the last reset."""

    _fields_ = [
        ("n_ubatch", ctypes.c_uint64),  # ubatches computed
        ("n_host_syncs", ctypes.c_uint64),  # graph cuts at MoE layers for the routing callback
        ("n_routed", ctypes.c_uint64),  # slots in the layers gated in the graph
        ("n_dropped", ctypes.c_uint64),  # of these, slots the gating rule dropped
        ("n_overlap", ctypes.c_uint64),  # device splits that ran on while the CPU computed (cache overlap)
    ]


class MoeIdsCheck(ctypes.Structure):
    """struct llama_moe_ids_check: rows of ids that a device's mul_mat_id / add_id would misread."""

    _fields_ = [
        ("n_nodes", ctypes.c_uint64),  # MUL_MAT_ID / ADD_ID nodes on a non-CPU backend checked
        ("n_rows", ctypes.c_uint64),  # id rows (one per token and node) checked
        ("n_negative", ctypes.c_uint64),  # rows with an id < 0
        ("n_range", ctypes.c_uint64),  # rows with an id past the stacked tensor's last expert (slot)
        ("n_repeat", ctypes.c_uint64),  # rows with an id twice
        ("first", ctypes.c_char * 128),  # the first failing node and row, "" when none
    ]


class MoePrefetchStats(ctypes.Structure):
    """struct llama_moe_prefetch_stats: the native promoe policy's counters."""

    _fields_ = [
        ("issued", ctypes.c_uint64),  # speculative loads queued for a prediction
        ("useful", ctypes.c_uint64),  # ... resident when their layer routed, which used the expert
        ("preempted", ctypes.c_uint64),  # ... dropped before their last chunk was issued
        ("predicted", ctypes.c_uint64),  # experts predicted for layers that then routed (sum |P|)
        ("in_time", ctypes.c_uint64),  # of those, resident when the layer routed
        ("routed", ctypes.c_uint64),  # experts the predicted layers used (sum |A|)
        ("correct", ctypes.c_uint64),  # of those, predicted (sum |P & A|)
    ]


class MoePrefillStats(ctypes.Structure):
    """struct llama_moe_prefill_stats: the prefill buffers' counters."""

    _fields_ = [
        (
            "ubatches",
            ctypes.c_uint64,
        ),  # ubatches that ran their cached layers' other experts from the buffers
        ("layers", ctypes.c_uint64),  # cached layers that ran so
        ("needed", ctypes.c_uint64),  # experts those layers ran from the buffers (routed, outside the slots)
        ("ahead", ctypes.c_uint64),  # experts copied one cached layer ahead
        ("ahead_used", ctypes.c_uint64),  # of those, the ones their layer needed
        ("late", ctypes.c_uint64),  # experts copied at their layer's routing callback (the compute waited)
        ("bytes", ctypes.c_uint64),  # bytes copied into the buffers
        ("buf_bytes", ctypes.c_uint64),  # the size of the two buffers
    ]


class MoeBorrowStats(ctypes.Structure):
    """struct llama_moe_borrow_stats: the slots lent to the prefill buffers."""

    _fields_ = [
        ("lent_layers", ctypes.c_uint64),  # cached layers whose slots hold the buffers (0: not borrowing)
        ("lent_slots", ctypes.c_uint64),  # their slots
        ("lends", ctypes.c_uint64),  # prefills that borrowed them
        ("evicted", ctypes.c_uint64),  # experts evicted from them at those lends
        ("refilled", ctypes.c_uint64),  # experts queued into them after the prefills (the most routed)
        ("refill_bytes", ctypes.c_uint64),  # those experts' bytes
        ("refused", ctypes.c_uint64),  # loads into them refused while lent
        ("lent_bytes", ctypes.c_uint64),  # the slots' bytes the buffers lie over
    ]


class MoePrecalcStats(ctypes.Structure):
    """struct llama_moe_precalc_stats: DAOP's pre-calculation counters."""

    _fields_ = [
        ("layers", ctypes.c_uint64),  # layer runs that took pre-calculated experts
        ("computed", ctypes.c_uint64),  # experts computed one layer early (predicted, outside the slots)
        ("used", ctypes.c_uint64),  # of those, the ones their layer routed
        ("late", ctypes.c_uint64),  # routed experts outside the slots not pre-calculated: run at their layer
    ]


class TensorBuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }"""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# -- what `edgemoe doctor` reports: ggml's version, its registries and devices, the CUDA runtime ----------
class DevCaps(ctypes.Structure):
    """struct ggml_backend_dev_caps"""

    _fields_ = [
        ("async_", ctypes.c_bool),
        ("host_buffer", ctypes.c_bool),
        ("buffer_from_host_ptr", ctypes.c_bool),
        ("events", ctypes.c_bool),
        ("mmap_support", ctypes.c_bool),
    ]


class DevProps(ctypes.Structure):
    """struct ggml_backend_dev_props"""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", DevCaps),
    ]


class BackendFeature(ctypes.Structure):
    """struct ggml_backend_feature { const char * name; const char * value; }"""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class GgmlInitParams(ctypes.Structure):
    """struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; }"""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h); filled by ggml_threadpool_params_init."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),  # all false: the default affinity
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),  # 0 no polling .. 100 aggressive
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


# C name -> mirror; what llama_edgemoe_struct_size answers for
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "llama_moe_route": MoeRoute,
    "llama_moe_cache_stats": MoeCacheStats,
    "llama_moe_stats": MoeStats,
    "llama_moe_ids_check": MoeIdsCheck,
    "llama_moe_prefetch_stats": MoePrefetchStats,
    "llama_moe_prefill_stats": MoePrefillStats,
    "llama_moe_borrow_stats": MoeBorrowStats,
    "llama_moe_precalc_stats": MoePrecalcStats,
    "llama_model_tensor_buft_override": TensorBuftOverride,
    "ggml_backend_dev_props": DevProps,
    "ggml_backend_dev_caps": DevCaps,
    "ggml_backend_feature": BackendFeature,
    "ggml_init_params": GgmlInitParams,
    "ggml_threadpool_params": ThreadpoolParams,
}

# size_t llama_edgemoe_struct_size(const char * name);
_struct_size = declare("llama_edgemoe_struct_size", [ctypes.c_char_p], ctypes.c_size_t)


def library_size(name: str) -> int | None:
    """The C sizeof of a mirrored struct as the loaded library reports it (0: not one it knows; None: a library
    without the function)."""
    return int(_struct_size(name.encode())) if _struct_size is not None else None


def size_mismatches() -> dict[str, tuple[int, int | None]]:
    """{C name: (ctypes.sizeof of the mirror, the library's sizeof)} for every mirror whose sizes differ."""
    out: dict[str, tuple[int, int | None]] = {}
    for name, mirror in MIRRORS.items():
        lib_size = library_size(name)
        if lib_size != ctypes.sizeof(mirror):
            out[name] = (ctypes.sizeof(mirror), lib_size)
    return out


def markdown() -> str:
    """The list of mirrors docs/upgrading-llama.md carries (tests/test_docs_names.py checks it is this)."""
    return "".join(f"- `{name}` (`{mirror.__name__}`)\n" for name, mirror in MIRRORS.items())
