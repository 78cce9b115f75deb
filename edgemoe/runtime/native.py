"""The one native boundary: loads llama-cpp-python's library and declares edgemoe's C API.

Every ctypes declaration for functions added by patches/ lives here, each with
its C prototype quoted. The rest of edgemoe imports ``lib`` (llama_cpp's
low-level module) and the typed wrappers below; nothing else touches ctypes
function declarations.
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections import deque
from typing import Any

import numpy as np

from ..errors import NativeLibraryError

# The patch level this edgemoe needs: set once by the series' first patch (patches/README.md); raise it with
# the C side when the API these bindings use changes.
REQUIRED_PATCH_LEVEL = 25

log = logging.getLogger(__name__)

try:
    import llama_cpp.llama_cpp as lib  # low-level bindings; we never use the high-level Llama class
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    raise NativeLibraryError(
        f"llama-cpp-python is not importable ({err}); run `make install` to build the patched "
        "llama.cpp into .venv") from err

_cdll: ctypes.CDLL = lib._lib


def _declare(name: str, argtypes: list[Any], restype: Any, dll: ctypes.CDLL | None = None) -> Any:
    """Declare a function of libllama (or of dll); None when the library lacks it."""
    fn = getattr(dll if dll is not None else _cdll, name, None)
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


# int32_t llama_edgemoe_patch_level(void);
_patch_level = _declare("llama_edgemoe_patch_level", [], ctypes.c_int32)


# enum llama_moe_hook_flags
MOE_HOOK_PROBS = 1 << 0
MOE_HOOK_GATE_INP = 1 << 1


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


# typedef bool (*llama_moe_hook_fn)(struct llama_moe_route * route, void * user_data);
MoeHookFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(MoeRoute), ctypes.c_void_p)

# void llama_moe_set_hook(struct llama_context * ctx, llama_moe_hook_fn fn, void * user_data, uint32_t flags);
_moe_set_hook = _declare("llama_moe_set_hook", [ctypes.c_void_p, MoeHookFn, ctypes.c_void_p, ctypes.c_uint32], None)


def moe_set_hook(ctx: Any, fn: Any | None, flags: int) -> None:
    """Set (fn: a MoeHookFn the caller keeps alive) or clear (fn None) the context's MoE hook."""
    if _moe_set_hook is None:
        require_patched()
    _moe_set_hook(ctx, fn if fn is not None else MoeHookFn(), None, flags)


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
        ("preempted", ctypes.c_uint64),  # queued or copying loads dropped before completing (patch 0011)
        ("us_issue", ctypes.c_uint64),  # host time queueing copies (the CPU stand-in: the copies themselves)
        ("load_waits", ctypes.c_uint64),  # loads the compute stream waited for at a ubatch start (patch 0017)
        ("chunks_async", ctypes.c_uint64),  # of the chunks, those the load worker issued (patch 0018)
        ("us_worker", ctypes.c_uint64),  # host time the caller waited for the worker to finish a chunk (0018)
        ("chunks_staged", ctypes.c_uint64),  # of the chunks, those sent from a staging buffer (0020)
        ("routes_async", ctypes.c_uint64),  # ubatches whose routes the worker's policy step processed (0022)
        ("waits_timed", ctypes.c_uint64),  # of the load waits, those the worker timed (0022)
        ("us_load_wait", ctypes.c_uint64),  # their time from the compute's wait to the copies' end: an upper bound
    ]


# enum llama_moe_cache_state
MOE_CACHE_ABSENT, MOE_CACHE_QUEUED, MOE_CACHE_COPYING, MOE_CACHE_RESIDENT = 0, 1, 2, 3


# int32_t llama_moe_cache_init(struct llama_context * ctx, ggml_backend_dev_t dev, const int32_t * n_slots);
_moe_cache_init = _declare("llama_moe_cache_init", [ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32)
# bool llama_moe_cache_set_source(struct llama_context * ctx, int32_t il, const void * const * data);
# data: LLAMA_MOE_CACHE_N_SOURCES pointers (include/llama.h lists their order)
MOE_CACHE_N_SOURCES = 11
_moe_cache_set_source = _declare("llama_moe_cache_set_source", [ctypes.c_void_p, ctypes.c_int32,
                                                                ctypes.POINTER(ctypes.c_void_p)], ctypes.c_bool)
# bool llama_moe_cache_load(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot);
_moe_cache_load = _declare("llama_moe_cache_load", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                    ctypes.c_int32], ctypes.c_bool)
# const int32_t * llama_moe_cache_slots(const struct llama_context * ctx, int32_t il);
_moe_cache_slots = _declare("llama_moe_cache_slots", [ctypes.c_void_p, ctypes.c_int32],
                            ctypes.POINTER(ctypes.c_int32))
# bool llama_moe_cache_prefetch(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t priority);
_moe_cache_prefetch = _declare("llama_moe_cache_prefetch", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                            ctypes.c_int32, ctypes.c_int32], ctypes.c_bool)
# int32_t llama_moe_cache_issue_loads(struct llama_context * ctx, int32_t max_chunks);
_moe_cache_issue_loads = _declare("llama_moe_cache_issue_loads", [ctypes.c_void_p, ctypes.c_int32],
                                  ctypes.c_int32)
# void llama_moe_cache_sync(struct llama_context * ctx);
_moe_cache_sync = _declare("llama_moe_cache_sync", [ctypes.c_void_p], None)
# enum llama_moe_cache_state llama_moe_cache_get_state(const struct llama_context * ctx, int32_t il, int32_t expert);
_moe_cache_get_state = _declare("llama_moe_cache_get_state", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32],
                                ctypes.c_int)
# struct llama_moe_cache_stats llama_moe_cache_get_stats(const struct llama_context * ctx);
_moe_cache_get_stats = _declare("llama_moe_cache_get_stats", [ctypes.c_void_p], MoeCacheStats)
# void llama_moe_cache_reset_stats(struct llama_context * ctx);
_moe_cache_reset_stats = _declare("llama_moe_cache_reset_stats", [ctypes.c_void_p], None)


# enum llama_moe_gating_rule
MOE_GATING_NONE = 0
MOE_GATING_SCORE = 1
MOE_GATING_SER = 2
MOE_GATING_SENSITIVITY = 3


class MoeStats(ctypes.Structure):
    """struct llama_moe_stats: what the MoE control path did since the last reset."""

    _fields_ = [
        ("n_ubatch", ctypes.c_uint64),  # ubatches computed
        ("n_host_syncs", ctypes.c_uint64),  # graph cuts at MoE layers for the routing callback
        ("n_routed", ctypes.c_uint64),  # slots in the layers gated in the graph
        ("n_dropped", ctypes.c_uint64),  # of these, slots the gating rule dropped
        ("n_overlap", ctypes.c_uint64),  # device splits that ran on while the CPU computed (cache overlap)
    ]


# int32_t llama_moe_set_gating(struct llama_context * ctx, enum llama_moe_gating_rule rule, double threshold,
#                              const double * sensitivity, bool decode_only);
_moe_set_gating = _declare("llama_moe_set_gating", [ctypes.c_void_p, ctypes.c_int, ctypes.c_double,
                                                    ctypes.POINTER(ctypes.c_double), ctypes.c_bool], ctypes.c_int32)
# struct llama_moe_stats llama_moe_get_stats(struct llama_context * ctx);
_moe_get_stats = _declare("llama_moe_get_stats", [ctypes.c_void_p], MoeStats)
# void llama_moe_reset_stats(struct llama_context * ctx);
_moe_reset_stats = _declare("llama_moe_reset_stats", [ctypes.c_void_p], None)


def moe_set_gating(ctx: Any, rule: int, threshold: float, sensitivity: list[float] | None,
                   decode_only: bool) -> int:
    """Adaptive top-k inside the graph (rule MOE_GATING_NONE turns it off); 0 on success."""
    if _moe_set_gating is None:
        require_patched()
    arr = (ctypes.c_double * len(sensitivity))(*sensitivity) if sensitivity is not None else None
    return int(_moe_set_gating(ctx, rule, threshold, arr, decode_only))


def moe_stats(ctx: Any) -> dict[str, int]:
    s = _moe_get_stats(ctx)
    return {name: int(getattr(s, name)) for name, _ in MoeStats._fields_}


def moe_reset_stats(ctx: Any) -> None:
    _moe_reset_stats(ctx)


# int32_t llama_moe_set_predictor(struct llama_context * ctx, int32_t il_src, int32_t il_target,
#                                 int32_t n_out, int32_t n_hidden, enum ggml_type type, const float * w1,
#                                 const float * b1, const float * w2, const float * b2, const float * skip);
_moe_set_predictor = _declare("llama_moe_set_predictor", [ctypes.c_void_p] + [ctypes.c_int32] * 4
                              + [ctypes.c_int] + [ctypes.c_void_p] * 5, ctypes.c_int32)
# void llama_moe_clear_predictors(struct llama_context * ctx);
_moe_clear_predictors = _declare("llama_moe_clear_predictors", [ctypes.c_void_p], None)
# int32_t llama_moe_get_predictions(struct llama_context * ctx, int32_t il_target, int32_t * ids,
#                                   int32_t n_max);
_moe_get_predictions = _declare("llama_moe_get_predictions",
                                [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32],
                                ctypes.c_int32)
# size_t llama_moe_predictor_bytes(const struct llama_context * ctx);
_moe_predictor_bytes = _declare("llama_moe_predictor_bytes", [ctypes.c_void_p], ctypes.c_size_t)


def _f32_ptr(a: np.ndarray | None) -> int | None:
    """The address of a C-contiguous float32 numpy array (None for None)."""
    if a is None:
        return None
    if a.dtype != np.float32 or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"llama_moe_set_predictor takes C-contiguous float32 arrays, got {a.dtype} "
                         f"{'contiguous' if a.flags['C_CONTIGUOUS'] else 'strided'}")
    return int(a.ctypes.data)


def moe_set_predictor(ctx: Any, il_src: int, il_target: int, n_out: int, type_id: int, w1: np.ndarray | None,
                      b1: np.ndarray | None, w2: np.ndarray | None, b2: np.ndarray | None,
                      skip: np.ndarray | None) -> int:
    """Predict layer il_target's top-n_out experts from il_src's router input in the graph (0 on success).

    Row-major float32 arrays in the C layout (None: absent): w1 (n_hidden, n_embd), b1 (n_hidden,),
    w2 (n_expert, n_hidden), b2 (n_expert,), skip (n_expert, n_embd) or None for il_target's own router;
    w1 None is a linear predictor (skip h + b2). The matrices are stored as ggml type type_id."""
    if _moe_set_predictor is None:
        require_patched()
    n_hidden = int(w1.shape[0]) if w1 is not None else 0
    return int(_moe_set_predictor(ctx, il_src, il_target, n_out, n_hidden, type_id, _f32_ptr(w1),
                                  _f32_ptr(b1), _f32_ptr(w2), _f32_ptr(b2), _f32_ptr(skip)))


def moe_clear_predictors(ctx: Any) -> None:
    if _moe_clear_predictors is None:
        require_patched()
    _moe_clear_predictors(ctx)


def moe_get_predictions(ctx: Any, il_target: int, n_out: int) -> np.ndarray | None:
    """The last ubatch's predicted ids of il_target as (n_tokens, n_out) int32; None without a predictor."""
    if _moe_get_predictions is None:
        require_patched()
    n = int(_moe_get_predictions(ctx, il_target, None, 0))
    if n < 0:
        return None
    out = np.empty((n // n_out, n_out), np.int32)
    if n:
        _moe_get_predictions(ctx, il_target, out.ctypes.data, n)
    return out


def moe_predictor_bytes(ctx: Any) -> int:
    return int(_moe_predictor_bytes(ctx)) if _moe_predictor_bytes is not None else 0


# enum llama_moe_cache_policy
MOE_CACHE_POLICY_CALLBACK = 0  # the routing callback maps each cached layer's ids (a host sync per layer)
MOE_CACHE_POLICY_MANUAL = 1  # expert-to-slot tables in the graph; only load/prefetch change them
MOE_CACHE_POLICY_LRU = 2  # tables in the graph; a native per-layer LRU after each ubatch
MOE_CACHE_POLICY_DALI = 3  # tables in the graph; DALI's workload-aware replacement after each ubatch (0019)
MOE_CACHE_POLICY_DAOP = 4  # tables in the graph; DAOP's swap after each prompt (0021)
MOE_CACHE_POLICY_PROMOE = 5  # the routing callback; ProMoE's prefetcher fed by the in-graph predictors (0023)

# int32_t llama_moe_cache_set_policy(struct llama_context * ctx, enum llama_moe_cache_policy policy);
_moe_cache_set_policy = _declare("llama_moe_cache_set_policy", [ctypes.c_void_p, ctypes.c_int], ctypes.c_int32)


def moe_cache_set_policy(ctx: Any, policy: int) -> int:
    return int(_moe_cache_set_policy(ctx, policy))


# void llama_moe_cache_set_overlap(struct llama_context * ctx, bool overlap);
_moe_cache_set_overlap = _declare("llama_moe_cache_set_overlap", [ctypes.c_void_p, ctypes.c_bool], None)


def moe_cache_set_overlap(ctx: Any, overlap: bool) -> None:
    """Let the cache's device compute its experts while the CPU computes the others (the default)."""
    _moe_cache_set_overlap(ctx, overlap)


# int32_t llama_moe_cache_set_window_replacement(struct llama_context * ctx, int32_t window, int32_t update);
_moe_cache_set_window_replacement = _declare("llama_moe_cache_set_window_replacement",
                                             [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32],
                                             ctypes.c_int32)


def moe_cache_set_window_replacement(ctx: Any, window: int, update: int) -> int:
    """Window replacement (the native DALI policy): its window (tokens) and update (experts swapped per
    window); 0, or -1 if refused."""
    return int(_moe_cache_set_window_replacement(ctx, window, update))


# int32_t llama_moe_cache_set_prompt_swap(struct llama_context * ctx, double threshold);
_moe_cache_set_prompt_swap = _declare("llama_moe_cache_set_prompt_swap", [ctypes.c_void_p, ctypes.c_double],
                                      ctypes.c_int32)


def moe_cache_set_prompt_swap(ctx: Any, threshold: float) -> int:
    """Prompt swap (the native DAOP policy): its swap threshold (SwapInOut); 0, or -1 if refused (below 1)."""
    return int(_moe_cache_set_prompt_swap(ctx, threshold))


# int32_t llama_moe_cache_set_predicted_prefetch(struct llama_context * ctx, bool blocking,
#                                                double admit_bytes);
_moe_cache_set_predicted_prefetch = _declare("llama_moe_cache_set_predicted_prefetch",
                                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_double],
                                             ctypes.c_int32)


def moe_cache_set_predicted_prefetch(ctx: Any, blocking: bool, admit_bytes: float) -> int:
    """Predicted prefetch (the native ProMoE policy): blocking misses; admit_bytes, the bytes the copy stream
    moves per MoE layer time (0: admit every load); 0 on success."""
    return int(_moe_cache_set_predicted_prefetch(ctx, blocking, admit_bytes))


class MoePrefetchStats(ctypes.Structure):
    """struct llama_moe_prefetch_stats: the native promoe policy's counters (patch 0023)."""

    _fields_ = [
        ("issued", ctypes.c_uint64),  # speculative loads queued for a prediction
        ("useful", ctypes.c_uint64),  # ... resident when their layer routed, which used the expert
        ("preempted", ctypes.c_uint64),  # ... dropped before their last chunk was issued
        ("predicted", ctypes.c_uint64),  # experts predicted for layers that then routed (sum |P|)
        ("in_time", ctypes.c_uint64),  # of those, resident when the layer routed
        ("routed", ctypes.c_uint64),  # experts the predicted layers used (sum |A|)
        ("correct", ctypes.c_uint64),  # of those, predicted (sum |P & A|)
    ]


# struct llama_moe_prefetch_stats llama_moe_cache_get_prefetch_stats(const struct llama_context * ctx);
_moe_cache_get_prefetch_stats = _declare("llama_moe_cache_get_prefetch_stats", [ctypes.c_void_p], MoePrefetchStats)


def moe_cache_prefetch_stats(ctx: Any) -> dict[str, int]:
    s = _moe_cache_get_prefetch_stats(ctx)
    return {name: int(getattr(s, name)) for name, _ in MoePrefetchStats._fields_}


# int32_t llama_moe_cache_set_staging(struct llama_context * ctx, int32_t n_buffers, bool any_host);
_moe_cache_set_staging = _declare("llama_moe_cache_set_staging", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool],
                                  ctypes.c_int32)


def moe_cache_set_staging(ctx: Any, n_buffers: int, any_host: bool = False) -> int:
    """Send the cache's loads from n_buffers staging buffers in the device's host memory (pinned on CUDA; the
    library's default is 4; 0: from the mapped file); any_host: plain host memory where the device has no host
    buffer type (RPC: for tests). 0, or -1 if refused."""
    return int(_moe_cache_set_staging(ctx, n_buffers, any_host))


# enum llama_moe_prefill_ahead: what a prefill ubatch copies one cached layer ahead (patch 0025)
MOE_PREFILL_ROUTED = 0  # nothing ahead: each layer copies the experts it routes at its routing callback
MOE_PREFILL_ALL = 1  # the next cached layer's experts outside its slots
MOE_PREFILL_PREDICTED = 2  # those the in-graph predictor from this layer names (ALL where there is none)
MOE_PREFILL_AHEAD = {"routed": MOE_PREFILL_ROUTED, "all": MOE_PREFILL_ALL, "predicted": MOE_PREFILL_PREDICTED}


class MoePrefillStats(ctypes.Structure):
    """struct llama_moe_prefill_stats: the prefill buffers' counters (patch 0025)."""

    _fields_ = [
        ("ubatches", ctypes.c_uint64),  # ubatches that ran their cached layers' other experts from the buffers
        ("layers", ctypes.c_uint64),  # cached layers that ran so
        ("needed", ctypes.c_uint64),  # experts those layers ran from the buffers (routed, outside the slots)
        ("ahead", ctypes.c_uint64),  # experts copied one cached layer ahead
        ("ahead_used", ctypes.c_uint64),  # of those, the ones their layer needed
        ("late", ctypes.c_uint64),  # experts copied at their layer's routing callback (the compute waited)
        ("bytes", ctypes.c_uint64),  # bytes copied into the buffers
        ("buf_bytes", ctypes.c_uint64),  # the size of the two buffers
    ]


# int32_t llama_moe_cache_set_prefill(struct llama_context * ctx, int32_t n_min_tokens, enum llama_moe_prefill_ahead ahead);
_moe_cache_set_prefill = _declare("llama_moe_cache_set_prefill", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int],
                                  ctypes.c_int32)
# struct llama_moe_prefill_stats llama_moe_cache_get_prefill_stats(const struct llama_context * ctx);
_moe_cache_get_prefill_stats = _declare("llama_moe_cache_get_prefill_stats", [ctypes.c_void_p], MoePrefillStats)


def moe_cache_set_prefill(ctx: Any, n_min_tokens: int, ahead: int = MOE_PREFILL_ALL) -> int:
    """Ubatches of n_min_tokens+ tokens run each cached layer's other experts on the cache's device from two
    prefill buffers, copied one cached layer ahead (0: off). 0; -1 without a cache or for n < 0; -2 when the
    buffers cannot be allocated."""
    return int(_moe_cache_set_prefill(ctx, n_min_tokens, ahead))


def moe_cache_prefill_stats(ctx: Any) -> dict[str, int]:
    s = _moe_cache_get_prefill_stats(ctx)
    return {name: int(getattr(s, name)) for name, _ in MoePrefillStats._fields_}


class MoePrecalcStats(ctypes.Structure):
    """struct llama_moe_precalc_stats: DAOP's pre-calculation counters (patch 0026)."""

    _fields_ = [
        ("layers", ctypes.c_uint64),  # layer runs that took pre-calculated experts
        ("computed", ctypes.c_uint64),  # experts computed one layer early (predicted, outside the slots)
        ("used", ctypes.c_uint64),  # of those, the ones their layer routed
        ("late", ctypes.c_uint64),  # routed experts outside the slots not pre-calculated: run at their layer
    ]


# int32_t llama_moe_cache_set_precalc(struct llama_context * ctx, int32_t il_first, int32_t n_max_tokens);
_moe_cache_set_precalc = _declare("llama_moe_cache_set_precalc", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32],
                                  ctypes.c_int32)
# struct llama_moe_precalc_stats llama_moe_cache_get_precalc_stats(const struct llama_context * ctx);
_moe_cache_get_precalc_stats = _declare("llama_moe_cache_get_precalc_stats", [ctypes.c_void_p], MoePrecalcStats)


def moe_cache_set_precalc(ctx: Any, il_first: int, n_max_tokens: int) -> int:
    """DAOP's pre-calculation in ubatches of at most n_max_tokens tokens: each cached layer il >= il_first takes
    its predicted experts outside the slots from the MoE layer before, computed there on that layer's input
    (il_first < 0 or n_max_tokens 0: off). 0; -1 without a cache or for n_max_tokens < 0."""
    return int(_moe_cache_set_precalc(ctx, il_first, n_max_tokens))


def moe_cache_precalc_stats(ctx: Any) -> dict[str, int]:
    s = _moe_cache_get_precalc_stats(ctx)
    return {name: int(getattr(s, name)) for name, _ in MoePrecalcStats._fields_}


# void llama_moe_cache_set_async(struct llama_context * ctx, bool async);
_moe_cache_set_async = _declare("llama_moe_cache_set_async", [ctypes.c_void_p, ctypes.c_bool], None)


def moe_cache_set_async(ctx: Any, on: bool) -> None:
    """Issue the cache's queued loads from llama.cpp's load worker thread (on a device with events) or,
    off, from the caller's thread when it issues them or synchronises."""
    _moe_cache_set_async(ctx, on)


def moe_cache_init(ctx: Any, n_slots: list[int] | None, device: Any = None) -> int:
    """Give each layer n_slots[il] expert slots on device (None: the CPU stand-in); None removes the cache."""
    if _moe_cache_init is None:
        require_patched()
    arr = (ctypes.c_int32 * len(n_slots))(*n_slots) if n_slots is not None else None
    return int(_moe_cache_init(ctx, device, arr))


def moe_cache_set_source(ctx: Any, layer: int, pointers: list[int | None]) -> bool:
    """Where loads of the layer read: addresses of its stacked expert tensors' bytes (None: absent), in the
    order of expert_cache.EXPERT_TENSORS (gate_up, up, gate, down, their biases, the scales)."""
    if len(pointers) != MOE_CACHE_N_SOURCES:
        raise ValueError(f"{len(pointers)} sources, llama_moe_cache_set_source takes {MOE_CACHE_N_SOURCES}")
    arr = (ctypes.c_void_p * MOE_CACHE_N_SOURCES)(*pointers)
    return bool(_moe_cache_set_source(ctx, layer, arr))


def moe_cache_load(ctx: Any, layer: int, expert: int, slot: int) -> bool:
    """Copy expert into slot (expert -1 only evicts)."""
    return bool(_moe_cache_load(ctx, layer, expert, slot))


def moe_cache_slots(ctx: Any, layer: int, n_expert: int) -> list[int] | None:
    """The slot of each expert of the layer (-1: not resident), None when the layer has no slots."""
    p = _moe_cache_slots(ctx, layer)
    return [int(p[i]) for i in range(n_expert)] if p else None


def moe_cache_prefetch(ctx: Any, layer: int, expert: int, slot: int, priority: int = 0) -> bool:
    """Queue an asynchronous load (evicts the slot's expert now)."""
    return bool(_moe_cache_prefetch(ctx, layer, expert, slot, priority))


def moe_cache_issue_loads(ctx: Any, max_chunks: int = 2**31 - 1) -> int:
    """Issue up to max_chunks queued chunks, most urgent first; returns how many."""
    return int(_moe_cache_issue_loads(ctx, max_chunks))


def moe_cache_sync(ctx: Any) -> None:
    """Wait for the issued loads; they become resident."""
    _moe_cache_sync(ctx)


def moe_cache_state(ctx: Any, layer: int, expert: int) -> int:
    return int(_moe_cache_get_state(ctx, layer, expert))


def moe_cache_stats(ctx: Any) -> MoeCacheStats:
    return _moe_cache_get_stats(ctx)


def moe_cache_reset_stats(ctx: Any) -> None:
    _moe_cache_reset_stats(ctx)


# -- ggml device and buffer-type lookups (libggml / libggml-cpu beside libllama) ------------------------
# enum ggml_backend_dev_type (ACCEL 2, IGPU 3)
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1


def _sibling(soname: str) -> ctypes.CDLL | None:
    """The copy libllama itself loaded: by soname (pip installs libggml.so and libggml.so.0 as two
    files, and a second copy would have a registry of devices of its own)."""
    try:
        return ctypes.CDLL(soname)  # already loaded as libllama's dependency: the same object
    except OSError:
        return None


_ggml = _sibling("libggml.so.0")
_ggml_cpu = _sibling("libggml-cpu.so.0")
# ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
_dev_by_type = _declare("ggml_backend_dev_by_type", [ctypes.c_int], ctypes.c_void_p, _ggml)
# const char * ggml_backend_dev_name(ggml_backend_dev_t device);
_dev_name = _declare("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p, _ggml)
# void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
_dev_memory = _declare("ggml_backend_dev_memory", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                   ctypes.POINTER(ctypes.c_size_t)], None, _ggml)
# ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
_cpu_buft = _declare("ggml_backend_cpu_buffer_type", [], ctypes.c_void_p, _ggml_cpu)


def gpu_device() -> int | None:
    """The first GPU device of this build (a ggml_backend_dev_t), None in a CPU-only build."""
    return _dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) if _dev_by_type is not None else None


def device_name(dev: int) -> str:
    return _dev_name(dev).decode() if _dev_name is not None else "?"


def device_memory(dev: int) -> tuple[int, int]:
    """(free, total) bytes of a device."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


# ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
_reg_by_name = _declare("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p, _ggml)
# void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
_reg_proc = _declare("ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p, _ggml)
# void ggml_backend_register(ggml_backend_reg_t reg);
_register = _declare("ggml_backend_register", [ctypes.c_void_p], None, _ggml)
# ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
_reg_dev_get = _declare("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p, _ggml)
# size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
_reg_dev_count = _declare("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t, _ggml)

# void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
#                                    size_t n_devices, ggml_backend_dev_t * devices);
_RpcStartServer = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_void_p))
# ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
_RpcAddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


def rpc_loopback_device(port: int | None = None, n_threads: int = 1) -> int:
    """Start llama.cpp's RPC server on 127.0.0.1:port (None: a free port) in this process (serving the CPU
    backend from a daemon thread), register it, and return its device: a GPU-type device with its own
    buffers, async copies and events, reached over loopback. For tests of the cache's device paths without
    a GPU. Every model loaded afterwards in this process sees the device (run it in a process of its own).
    """
    import socket
    import threading
    import time

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]

    reg = _reg_by_name(b"RPC") if _reg_by_name is not None else None
    if not reg:
        raise NativeLibraryError("llama.cpp was built without the RPC backend: run `make install`")
    start = _RpcStartServer(_reg_proc(reg, b"ggml_backend_rpc_start_server"))
    add = _RpcAddServer(_reg_proc(reg, b"ggml_backend_rpc_add_server"))
    cpu = _dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    endpoint = f"127.0.0.1:{port}".encode()
    devs = (ctypes.c_void_p * 1)(cpu)
    threading.Thread(target=start, args=(endpoint, None, n_threads, 1, devs), daemon=True).start()
    time.sleep(0.3)  # the server binds its socket
    server = add(endpoint)
    if not server or _reg_dev_count(server) < 1:
        raise NativeLibraryError(f"no RPC device at {endpoint.decode()}")
    _register(server)
    return int(_reg_dev_get(server, 0))


class TensorBuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }"""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_overrides(patterns: list[str]) -> ctypes.Array[TensorBuftOverride]:
    """A NULL-terminated override list putting tensors matching the regexes in plain CPU buffers."""
    if _cpu_buft is None:
        raise NativeLibraryError("libggml-cpu does not export ggml_backend_cpu_buffer_type: run `make install`")
    arr = (TensorBuftOverride * (len(patterns) + 1))()
    for i, p in enumerate(patterns):
        arr[i].pattern = p.encode()
        arr[i].buft = _cpu_buft()
    return arr


def patch_level() -> int:
    """edgemoe patch series level compiled into libllama (0 = stock llama.cpp)."""
    return int(_patch_level()) if _patch_level is not None else 0


def require_patched() -> None:
    """Raise NativeLibraryError unless the loaded libllama carries our patch series."""
    level = patch_level()
    if level < REQUIRED_PATCH_LEVEL:
        where = getattr(_cdll, "_name", "libllama")
        raise NativeLibraryError(
            f"{where} is stock llama.cpp (edgemoe patch level {level}, need >= {REQUIRED_PATCH_LEVEL}); "
            "run `make install` (or `python tools/build_llama.py`) to build the patched library")


def supports_gpu_offload() -> bool:
    return bool(lib.llama_supports_gpu_offload())


def system_info() -> str:
    return lib.llama_print_system_info().decode("utf-8", errors="replace")


# llama.cpp logs go to Python logging (hidden unless --debug), not straight to stderr.
# ggml_log_level: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continues the previous message)
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("edgemoe.llama_cpp")
_partial: list[str] = []
_level = [logging.INFO]
_recent: deque[str] = deque(maxlen=40)  # last complete llama.cpp log lines
_errors: deque[tuple[int, str]] = deque(maxlen=20)  # (line number, line) of the last ERROR lines
_n_lines = [0]  # complete lines logged so far


@lib.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - native
    if level in _LOG_LEVELS:
        _level[0] = _LOG_LEVELS[level]
    _partial.append(text.decode("utf-8", errors="replace"))
    if _partial[-1].endswith("\n"):
        line = "".join(_partial).rstrip()
        _partial.clear()
        _recent.append(line)
        _n_lines[0] += 1
        if _level[0] >= logging.ERROR:
            _errors.append((_n_lines[0], line))
        _llama_log.log(_level[0], "%s", line)


# -- native aborts: one line, no debugger --------------------------------------------------------------
# ggml's abort path runs gdb/lldb for a backtrace when one is installed, which can hang a process
# for minutes; GGML_NO_BACKTRACE (read at abort time) turns that off unless edgemoe runs with --debug.
# typedef void (*ggml_abort_callback_t)(const char * error_message);
_AbortCallback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_ggml_base = _sibling("libggml-base.so.0")
# ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback);
_set_abort_callback = _declare("ggml_set_abort_callback", [_AbortCallback], ctypes.c_void_p, _ggml_base)
_backtrace_env_set = [False]


@_AbortCallback
def _on_native_abort(message: bytes | None) -> None:  # pragma: no cover - runs in a dying process
    text = (message or b"").decode("utf-8", errors="replace").strip()
    os.write(2, f"edgemoe: llama.cpp stopped on an internal error: {text} (a bug: please report it with the "
                "command; `edgemoe --debug` shows a native backtrace)\n".encode())


def set_native_debug(debug: bool) -> None:
    """debug: ggml's own abort output with a native backtrace; otherwise one line and no debugger."""
    if debug:
        if _backtrace_env_set[0]:
            os.environ.pop("GGML_NO_BACKTRACE", None)
            _backtrace_env_set[0] = False
        if _set_abort_callback is not None:
            _set_abort_callback(_AbortCallback())  # NULL: ggml's default
    else:
        if "GGML_NO_BACKTRACE" not in os.environ:
            os.environ["GGML_NO_BACKTRACE"] = "1"
            _backtrace_env_set[0] = True
        if _set_abort_callback is not None:
            _set_abort_callback(_on_native_abort)


set_native_debug(os.environ.get("EDGEMOE_DEBUG", "") not in ("", "0"))


def route_logs_to_python() -> None:
    lib.llama_log_set(_log_callback, ctypes.c_void_p(0))


def recent_log() -> str:
    """The last llama.cpp log lines (for error messages when a load fails)."""
    return "\n".join(_recent)


def log_mark() -> int:
    """A mark in llama.cpp's log: pass it to recent_error() to see only what was logged after it."""
    return _n_lines[0]


def recent_error(since: int = 0) -> str:
    """The first error llama.cpp logged after the mark `since`, as one line (else its last log line).

    A failed load logs its cause first ("gguf_init_from_reader: tensor 'x' has offset ...") and then
    generic lines ("failed to load model"); the cause is what a one-line error message wants.
    """
    errors = [line for n, line in _errors if n > since]
    line = errors[0] if errors else (_recent[-1] if _recent else "")
    return " ".join(line.split())


# -- ggml contexts, graphs, buffers and backends (edgemoe.perf.measure's microbenchmarks) -----------------
# enum ggml_type (ggml/include/ggml.h): the ids of the types the microbenchmarks build weights of
GGML_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
    "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20,
    "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "I8": 24, "I32": 26, "IQ1_M": 29, "BF16": 30, "MXFP4": 39,
}
GGML_TYPE_F32 = GGML_TYPES["F32"]
GGML_TYPE_I32 = GGML_TYPES["I32"]
GGML_TYPE_I8 = GGML_TYPES["I8"]
# enum ggml_status
GGML_STATUS_SUCCESS = 0
# GGML_MAX_N_THREADS (config.MAX_THREADS): the size of ggml_threadpool_params.cpumask
_GGML_MAX_N_THREADS = 512


class GgmlInitParams(ctypes.Structure):
    """struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; }"""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h); filled by ggml_threadpool_params_init."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * _GGML_MAX_N_THREADS),  # all false: the default affinity
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),  # 0 no polling .. 100 aggressive
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


_vp, _sz, _i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
# struct ggml_context * ggml_init(struct ggml_init_params params);
_ggml_init = _declare("ggml_init", [GgmlInitParams], _vp, _ggml_base)
# void ggml_free(struct ggml_context * ctx);
_ggml_free = _declare("ggml_free", [_vp], None, _ggml_base)
# size_t ggml_tensor_overhead(void);
_tensor_overhead = _declare("ggml_tensor_overhead", [], _sz, _ggml_base)
# size_t ggml_graph_overhead_custom(size_t size, bool grads);
_graph_overhead_custom = _declare("ggml_graph_overhead_custom", [_sz, ctypes.c_bool], _sz, _ggml_base)
# struct ggml_tensor * ggml_new_tensor(struct ggml_context * ctx, enum ggml_type type, int n_dims,
#                                      const int64_t * ne);
_new_tensor = _declare("ggml_new_tensor", [_vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_i64)], _vp,
                       _ggml_base)
# size_t ggml_nbytes(const struct ggml_tensor * tensor);
_nbytes = _declare("ggml_nbytes", [_vp], _sz, _ggml_base)
# int64_t ggml_blck_size(enum ggml_type type);
_blck_size = _declare("ggml_blck_size", [ctypes.c_int], _i64, _ggml_base)
# size_t ggml_row_size(enum ggml_type type, int64_t ne);
_row_size = _declare("ggml_row_size", [ctypes.c_int, _i64], _sz, _ggml_base)
# bool ggml_quantize_requires_imatrix(enum ggml_type type);
_quantize_requires_imatrix = _declare("ggml_quantize_requires_imatrix", [ctypes.c_int], ctypes.c_bool,
                                      _ggml_base)
# size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows,
#                            int64_t n_per_row, const float * imatrix);
_quantize_chunk = _declare("ggml_quantize_chunk", [ctypes.c_int, _vp, _vp, _i64, _i64, _i64, _vp], _sz,
                           _ggml_base)
# struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a,
#                                   struct ggml_tensor * b);
_mul_mat = _declare("ggml_mul_mat", [_vp, _vp, _vp], _vp, _ggml_base)
# struct ggml_tensor * ggml_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * as,
#                                      struct ggml_tensor * b, struct ggml_tensor * ids);
_mul_mat_id = _declare("ggml_mul_mat_id", [_vp, _vp, _vp, _vp], _vp, _ggml_base)
# struct ggml_tensor * ggml_swiglu_split(struct ggml_context * ctx, struct ggml_tensor * a,
#                                        struct ggml_tensor * b);
_swiglu_split = _declare("ggml_swiglu_split", [_vp, _vp, _vp], _vp, _ggml_base)
# struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
_add = _declare("ggml_add", [_vp, _vp, _vp], _vp, _ggml_base)
# struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
_scale = _declare("ggml_scale", [_vp, _vp, ctypes.c_float], _vp, _ggml_base)
# struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
_new_graph_custom = _declare("ggml_new_graph_custom", [_vp, _sz, ctypes.c_bool], _vp, _ggml_base)
# void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
_build_forward_expand = _declare("ggml_build_forward_expand", [_vp, _vp], None, _ggml_base)
# int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
_graph_n_nodes = _declare("ggml_graph_n_nodes", [_vp], ctypes.c_int, _ggml_base)

# ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
#                                                                ggml_backend_buffer_type_t buft);
_alloc_ctx_tensors_from_buft = _declare("ggml_backend_alloc_ctx_tensors_from_buft", [_vp, _vp], _vp,
                                        _ggml_base)
# ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
_buft_alloc_buffer = _declare("ggml_backend_buft_alloc_buffer", [_vp, _sz], _vp, _ggml_base)
# const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
_buft_name = _declare("ggml_backend_buft_name", [_vp], ctypes.c_char_p, _ggml_base)
# bool ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);
_buft_is_host = _declare("ggml_backend_buft_is_host", [_vp], ctypes.c_bool, _ggml_base)
# void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
_buffer_free = _declare("ggml_backend_buffer_free", [_vp], None, _ggml_base)
# void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
_buffer_clear = _declare("ggml_backend_buffer_clear", [_vp, ctypes.c_uint8], None, _ggml_base)
# void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
_buffer_get_base = _declare("ggml_backend_buffer_get_base", [_vp], _vp, _ggml_base)
# enum ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor,
#                                            void * addr);
_tensor_alloc = _declare("ggml_backend_tensor_alloc", [_vp, _vp, _vp], ctypes.c_int, _ggml_base)
# void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
_tensor_set = _declare("ggml_backend_tensor_set", [_vp, _vp, _sz, _sz], None, _ggml_base)
# void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
_tensor_get = _declare("ggml_backend_tensor_get", [_vp, _vp, _sz, _sz], None, _ggml_base)
# void ggml_backend_tensor_set_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data,
#                                    size_t offset, size_t size);
_tensor_set_async = _declare("ggml_backend_tensor_set_async", [_vp, _vp, _vp, _sz, _sz], None, _ggml_base)

# void ggml_backend_free(ggml_backend_t backend);
_backend_free = _declare("ggml_backend_free", [_vp], None, _ggml_base)
# const char * ggml_backend_name(ggml_backend_t backend);
_backend_name = _declare("ggml_backend_name", [_vp], ctypes.c_char_p, _ggml_base)
# ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
_backend_default_buft = _declare("ggml_backend_get_default_buffer_type", [_vp], _vp, _ggml_base)
# enum ggml_status ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
_graph_compute = _declare("ggml_backend_graph_compute", [_vp, _vp], ctypes.c_int, _ggml_base)
# struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);
_graph_node = _declare("ggml_graph_node", [_vp, ctypes.c_int], _vp, _ggml_base)
# void ggml_backend_synchronize(ggml_backend_t backend);
_backend_synchronize = _declare("ggml_backend_synchronize", [_vp], None, _ggml_base)
# ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
_dev_init = _declare("ggml_backend_dev_init", [_vp, ctypes.c_char_p], _vp, _ggml_base)
# enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
_dev_type = _declare("ggml_backend_dev_type", [_vp], ctypes.c_int, _ggml_base)
# ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
_dev_backend_reg = _declare("ggml_backend_dev_backend_reg", [_vp], _vp, _ggml_base)
# ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
_dev_buft = _declare("ggml_backend_dev_buffer_type", [_vp], _vp, _ggml_base)
# ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device);
_dev_host_buft = _declare("ggml_backend_dev_host_buffer_type", [_vp], _vp, _ggml_base)
# bool ggml_backend_dev_supports_op(ggml_backend_dev_t device, const struct ggml_tensor * op);
_dev_supports_op = _declare("ggml_backend_dev_supports_op", [_vp, _vp], ctypes.c_bool, _ggml_base)
# typedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device);
_GetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(_vp), _vp)

# ggml_backend_t ggml_backend_cpu_init(void);
_cpu_init = _declare("ggml_backend_cpu_init", [], _vp, _ggml_cpu)
# void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
_cpu_set_n_threads = _declare("ggml_backend_cpu_set_n_threads", [_vp, ctypes.c_int], None, _ggml_cpu)
# void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, ggml_threadpool_t threadpool);
_cpu_set_threadpool = _declare("ggml_backend_cpu_set_threadpool", [_vp, _vp], None, _ggml_cpu)
# void ggml_threadpool_params_init(struct ggml_threadpool_params * p, int n_threads);
_threadpool_params_init = _declare("ggml_threadpool_params_init",
                                   [ctypes.POINTER(ThreadpoolParams), ctypes.c_int], None, _ggml_base)
# struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
_threadpool_new = _declare("ggml_threadpool_new", [ctypes.POINTER(ThreadpoolParams)], _vp, _ggml_cpu)
# void ggml_threadpool_free(struct ggml_threadpool * threadpool);
_threadpool_free = _declare("ggml_threadpool_free", [_vp], None, _ggml_cpu)


def _require(*fns: Any) -> None:
    if any(fn is None for fn in fns):
        raise NativeLibraryError("the ggml libraries beside libllama lack a function edgemoe's "
                                 "microbenchmarks call (a stock or partial build?): run `make install`")


def require_ggml() -> None:
    """Raise NativeLibraryError unless every ggml function the microbenchmarks call was found."""
    _require(_ggml_init, _ggml_free, _tensor_overhead, _graph_overhead_custom, _new_tensor, _nbytes,
             _blck_size, _row_size, _quantize_requires_imatrix, _quantize_chunk, _mul_mat, _mul_mat_id,
             _swiglu_split, _add, _scale, _new_graph_custom, _build_forward_expand, _graph_n_nodes,
             _alloc_ctx_tensors_from_buft, _buft_alloc_buffer, _buft_name, _buft_is_host, _buffer_free,
             _buffer_clear, _buffer_get_base, _tensor_alloc, _tensor_set, _tensor_get, _tensor_set_async, _backend_free, _backend_name, _backend_default_buft,
             _graph_compute, _graph_node, _backend_synchronize, _dev_init, _dev_type, _dev_backend_reg, _dev_buft,
             _dev_host_buft, _dev_supports_op, _cpu_init, _cpu_set_n_threads, _cpu_set_threadpool,
             _threadpool_params_init, _threadpool_new, _threadpool_free, _dev_by_type, _reg_proc, _cpu_buft)


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


def ggml_block_size(type_id: int) -> int:
    return int(_blck_size(type_id))


def ggml_row_size(type_id: int, n: int) -> int:
    """Bytes of a row of n elements of the type."""
    return int(_row_size(type_id, n))


def ggml_quantize_requires_imatrix(type_id: int) -> bool:
    return bool(_quantize_requires_imatrix(type_id))


def ggml_quantize_rows(type_id: int, src: int, dst: int, n_rows: int, n_per_row: int,
                       imatrix: int | None = None) -> int:
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
    return _ptr(_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) if _dev_by_type is not None else None,
                "ggml_backend_dev_by_type(CPU)")


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
    proc = _reg_proc(_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
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
    _require(_cpu_buft)
    return _ptr(_cpu_buft(), "ggml_backend_cpu_buffer_type")


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
    return _ptr(_dev_init(dev, None), f"ggml_backend_dev_init({device_name(dev)})")


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
        raise NativeLibraryError(f"ggml_backend_graph_compute on {backend_name(backend)} failed "
                                 f"(status {status})")
    _backend_synchronize(backend)
    probe = ctypes.c_float()
    _tensor_get(_graph_node(graph, -1), ctypes.byref(probe), 0, 4)


def backend_synchronize(backend: int) -> None:
    _backend_synchronize(backend)
