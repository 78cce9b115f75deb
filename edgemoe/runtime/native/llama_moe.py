"""The llama_moe_* C API the patch series adds (include/llama.h), each binding under its C prototype."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .loader import GgmlDevice, LlamaContext, declare, missing_native
from .structs import (
    MoeBorrowStats,
    MoeCacheStats,
    MoeIdsCheck,
    MoePrecalcStats,
    MoePrefetchStats,
    MoePrefillStats,
    MoeRoute,
    MoeStats,
)

# enum llama_moe_hook_flags
MOE_HOOK_PROBS = 1 << 0
MOE_HOOK_GATE_INP = 1 << 1


# typedef bool (*llama_moe_hook_fn)(struct llama_moe_route * route, void * user_data);
MoeHookFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(MoeRoute), ctypes.c_void_p)

# void llama_moe_set_hook(struct llama_context * ctx, llama_moe_hook_fn fn, void * user_data, uint32_t flags);
_moe_set_hook = declare(
    "llama_moe_set_hook", [ctypes.c_void_p, MoeHookFn, ctypes.c_void_p, ctypes.c_uint32], None
)


def moe_set_hook(ctx: LlamaContext, fn: Any | None, flags: int) -> None:
    """Set (fn: a MoeHookFn the caller keeps alive) or clear (fn None) the context's MoE hook."""
    if _moe_set_hook is None:
        missing_native()
    _moe_set_hook(ctx, fn if fn is not None else MoeHookFn(), None, flags)


# enum llama_moe_cache_state
MOE_CACHE_ABSENT, MOE_CACHE_QUEUED, MOE_CACHE_COPYING, MOE_CACHE_RESIDENT = 0, 1, 2, 3


# int32_t llama_moe_cache_init(struct llama_context * ctx, ggml_backend_dev_t dev, const int32_t * n_slots);
_moe_cache_init = declare(
    "llama_moe_cache_init", [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32
)
# bool llama_moe_cache_set_source(struct llama_context * ctx, int32_t il, const void * const * data);
# data: LLAMA_MOE_CACHE_N_SOURCES pointers (include/llama.h lists their order)
MOE_CACHE_N_SOURCES = 11
_moe_cache_set_source = declare(
    "llama_moe_cache_set_source",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)],
    ctypes.c_bool,
)
# bool llama_moe_cache_load(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot);
_moe_cache_load = declare(
    "llama_moe_cache_load", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], ctypes.c_bool
)
# const int32_t * llama_moe_cache_slots(const struct llama_context * ctx, int32_t il);
_moe_cache_slots = declare(
    "llama_moe_cache_slots", [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_int32)
)
# bool llama_moe_cache_prefetch(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t priority);
_moe_cache_prefetch = declare(
    "llama_moe_cache_prefetch",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32],
    ctypes.c_bool,
)
# int32_t llama_moe_cache_issue_loads(struct llama_context * ctx, int32_t max_chunks);
_moe_cache_issue_loads = declare(
    "llama_moe_cache_issue_loads", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32
)
# void llama_moe_cache_sync(struct llama_context * ctx);
_moe_cache_sync = declare("llama_moe_cache_sync", [ctypes.c_void_p], None)
# enum llama_moe_cache_state llama_moe_cache_get_state(const struct llama_context * ctx, int32_t il, int32_t expert);
_moe_cache_get_state = declare(
    "llama_moe_cache_get_state", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int
)
# struct llama_moe_cache_stats llama_moe_cache_get_stats(const struct llama_context * ctx);
_moe_cache_get_stats = declare("llama_moe_cache_get_stats", [ctypes.c_void_p], MoeCacheStats)
# void llama_moe_cache_reset_stats(struct llama_context * ctx);
_moe_cache_reset_stats = declare("llama_moe_cache_reset_stats", [ctypes.c_void_p], None)


# enum ggml_moe_gate_rule: the rule of llama_moe_set_gating and of the ggml_moe_gate op (one numbering)
MOE_GATING_NONE = -1  # LLAMA_MOE_GATING_OFF
MOE_GATING_SCORE = 0  # GGML_MOE_GATE_SCORE
MOE_GATING_SER = 1  # GGML_MOE_GATE_SER
MOE_GATING_SENSITIVITY = 2  # GGML_MOE_GATE_SENSITIVITY


# int32_t llama_moe_set_gating(struct llama_context * ctx, enum ggml_moe_gate_rule rule, double threshold,
#                              const double * sensitivity, bool decode_only);
_moe_set_gating = declare(
    "llama_moe_set_gating",
    [ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.POINTER(ctypes.c_double), ctypes.c_bool],
    ctypes.c_int32,
)
# struct llama_moe_stats llama_moe_get_stats(struct llama_context * ctx);
_moe_get_stats = declare("llama_moe_get_stats", [ctypes.c_void_p], MoeStats)
# void llama_moe_reset_stats(struct llama_context * ctx);
_moe_reset_stats = declare("llama_moe_reset_stats", [ctypes.c_void_p], None)


def moe_set_gating(
    ctx: LlamaContext, rule: int, threshold: float, sensitivity: list[float] | None, decode_only: bool
) -> int:
    """Adaptive top-k inside the graph (rule MOE_GATING_NONE turns it off); 0 on success."""
    if _moe_set_gating is None:
        missing_native()
    arr = (ctypes.c_double * len(sensitivity))(*sensitivity) if sensitivity is not None else None
    return int(_moe_set_gating(ctx, rule, threshold, arr, decode_only))


def moe_stats(ctx: LlamaContext) -> dict[str, int]:
    s = _moe_get_stats(ctx)
    return {name: int(getattr(s, name)) for name, *_ in MoeStats._fields_}


def moe_reset_stats(ctx: LlamaContext) -> None:
    _moe_reset_stats(ctx)


# void llama_moe_set_ids_check(struct llama_context * ctx, bool on);
_moe_set_ids_check = declare("llama_moe_set_ids_check", [ctypes.c_void_p, ctypes.c_bool], None)
# struct llama_moe_ids_check llama_moe_get_ids_check(const struct llama_context * ctx);
_moe_get_ids_check = declare("llama_moe_get_ids_check", [ctypes.c_void_p], MoeIdsCheck)


def moe_set_ids_check(ctx: LlamaContext, on: bool) -> None:
    """Check every id row handed to a device's mul_mat_id / add_id from now on (counts reset); slow: tests, doctor."""
    if _moe_set_ids_check is None:
        missing_native()
    _moe_set_ids_check(ctx, on)


def moe_ids_check(ctx: LlamaContext) -> dict[str, int | str]:
    """The checker's counts since it was switched on; "first" names the first failing node and its row."""
    if _moe_get_ids_check is None:
        missing_native()
    s = _moe_get_ids_check(ctx)
    out: dict[str, int | str] = {name: int(getattr(s, name)) for name, *_ in MoeIdsCheck._fields_[:-1]}
    out["first"] = bytes(s.first).split(b"\0", 1)[0].decode("utf-8", errors="replace")
    return out


# enum llama_moe_device_ids: how a device's mul_mat_id / add_id get skipped ids
MOE_DEVICE_IDS_FILL, MOE_DEVICE_IDS_RAW = 0, 1

# void llama_moe_set_device_ids(struct llama_context * ctx, ggml_backend_dev_t dev, enum llama_moe_device_ids mode);
_moe_set_device_ids = declare(
    "llama_moe_set_device_ids", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], None
)
# enum llama_moe_device_ids llama_moe_get_device_ids(const struct llama_context * ctx, ggml_backend_dev_t dev);
_moe_get_device_ids = declare("llama_moe_get_device_ids", [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)


def moe_set_device_ids(ctx: LlamaContext, dev: GgmlDevice | None, raw: bool) -> None:
    """Device dev's (None: every device's) mul_mat_id / add_id get skipped ids as -1 (raw) or filled with spare rows
    and masked (the default) in the graphs built from now on."""
    if _moe_set_device_ids is None:
        missing_native()
    _moe_set_device_ids(ctx, dev, MOE_DEVICE_IDS_RAW if raw else MOE_DEVICE_IDS_FILL)


def moe_device_ids_raw(ctx: LlamaContext, dev: GgmlDevice | None) -> bool:
    """Whether device dev gets skipped ids as -1."""
    if _moe_get_device_ids is None:
        missing_native()
    return int(_moe_get_device_ids(ctx, dev)) == MOE_DEVICE_IDS_RAW


# int32_t llama_moe_set_predictor(struct llama_context * ctx, int32_t il_src, int32_t il_target,
#                                 int32_t n_out, int32_t n_hidden, enum ggml_type type, const float * w1,
#                                 const float * b1, const float * w2, const float * b2, const float * skip);
_moe_set_predictor = declare(
    "llama_moe_set_predictor",
    [ctypes.c_void_p] + [ctypes.c_int32] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 5,
    ctypes.c_int32,
)
# void llama_moe_clear_predictors(struct llama_context * ctx);
_moe_clear_predictors = declare("llama_moe_clear_predictors", [ctypes.c_void_p], None)
# int32_t llama_moe_get_predictions(struct llama_context * ctx, int32_t il_target, int32_t * ids,
#                                   int32_t n_max);
_moe_get_predictions = declare(
    "llama_moe_get_predictions",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32],
    ctypes.c_int32,
)
# size_t llama_moe_predictor_bytes(const struct llama_context * ctx);
_moe_predictor_bytes = declare("llama_moe_predictor_bytes", [ctypes.c_void_p], ctypes.c_size_t)


def _f32_ptr(a: np.ndarray | None) -> int | None:
    """The address of a C-contiguous float32 numpy array (None for None)."""
    if a is None:
        return None
    if a.dtype != np.float32 or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(
            f"llama_moe_set_predictor takes C-contiguous float32 arrays, got {a.dtype} "
            f"{'contiguous' if a.flags['C_CONTIGUOUS'] else 'strided'}"
        )
    return int(a.ctypes.data)


def moe_set_predictor(
    ctx: LlamaContext,
    il_src: int,
    il_target: int,
    n_out: int,
    type_id: int,
    w1: np.ndarray | None,
    b1: np.ndarray | None,
    w2: np.ndarray | None,
    b2: np.ndarray | None,
    skip: np.ndarray | None,
) -> int:
    """Predict layer il_target's top-n_out experts from il_src's router input in the graph (0 on success).

    Row-major float32 arrays in the C layout (None: absent): w1 (n_hidden, n_embd), b1 (n_hidden,),
    w2 (n_expert, n_hidden), b2 (n_expert,), skip (n_expert, n_embd) or None for il_target's own router;
    w1 None is a linear predictor (skip h + b2). The matrices are stored as ggml type type_id."""
    if _moe_set_predictor is None:
        missing_native()
    n_hidden = int(w1.shape[0]) if w1 is not None else 0
    return int(
        _moe_set_predictor(
            ctx,
            il_src,
            il_target,
            n_out,
            n_hidden,
            type_id,
            _f32_ptr(w1),
            _f32_ptr(b1),
            _f32_ptr(w2),
            _f32_ptr(b2),
            _f32_ptr(skip),
        )
    )


def moe_clear_predictors(ctx: LlamaContext) -> None:
    if _moe_clear_predictors is None:
        missing_native()
    _moe_clear_predictors(ctx)


def moe_get_predictions(ctx: LlamaContext, il_target: int, n_out: int) -> np.ndarray | None:
    """The last ubatch's predicted ids of il_target as (n_tokens, n_out) int32; None without a predictor."""
    if _moe_get_predictions is None:
        missing_native()
    n = int(_moe_get_predictions(ctx, il_target, None, 0))
    if n < 0:
        return None
    out = np.empty((n // n_out, n_out), np.int32)
    if n:
        _moe_get_predictions(ctx, il_target, out.ctypes.data, n)
    return out


def moe_predictor_bytes(ctx: LlamaContext) -> int:
    return int(_moe_predictor_bytes(ctx)) if _moe_predictor_bytes is not None else 0


# enum llama_moe_cache_policy
MOE_CACHE_POLICY_CALLBACK = 0  # the routing callback maps each cached layer's ids (a host sync per layer)
MOE_CACHE_POLICY_MANUAL = 1  # expert-to-slot tables in the graph; only load/prefetch change them
MOE_CACHE_POLICY_LRU = 2  # tables in the graph; a native per-layer LRU after each ubatch
MOE_CACHE_POLICY_WINDOW_REPLACEMENT = (
    3  # tables in the graph; DALI's workload-aware replacement after each ubatch
)
MOE_CACHE_POLICY_PROMPT_SWAP = 4  # tables in the graph; DAOP's swap after each prompt
MOE_CACHE_POLICY_PREDICTED_PREFETCH = (
    5  # the routing callback; ProMoE's prefetcher fed by the in-graph predictors
)

# int32_t llama_moe_cache_set_policy(struct llama_context * ctx, enum llama_moe_cache_policy policy);
_moe_cache_set_policy = declare("llama_moe_cache_set_policy", [ctypes.c_void_p, ctypes.c_int], ctypes.c_int32)


# the per-ubatch steps a residency policy's spec can name (edgemoe.policies.registry.NativeStep.step)
MOE_CACHE_STEPS = {
    "manual": MOE_CACHE_POLICY_MANUAL,
    "lru": MOE_CACHE_POLICY_LRU,
    "window_replacement": MOE_CACHE_POLICY_WINDOW_REPLACEMENT,
    "prompt_swap": MOE_CACHE_POLICY_PROMPT_SWAP,
}


def moe_cache_set_policy(ctx: LlamaContext, policy: int) -> int:
    return int(_moe_cache_set_policy(ctx, policy))


# void llama_moe_cache_set_overlap(struct llama_context * ctx, bool overlap);
_moe_cache_set_overlap = declare("llama_moe_cache_set_overlap", [ctypes.c_void_p, ctypes.c_bool], None)


def moe_cache_set_overlap(ctx: LlamaContext, overlap: bool) -> None:
    """Let the cache's device compute its experts while the CPU computes the others (the default)."""
    _moe_cache_set_overlap(ctx, overlap)


# int32_t llama_moe_cache_set_window_replacement(struct llama_context * ctx, int32_t window, int32_t update);
_moe_cache_set_window_replacement = declare(
    "llama_moe_cache_set_window_replacement",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32],
    ctypes.c_int32,
)


def moe_cache_set_window_replacement(ctx: LlamaContext, window: int, update: int) -> int:
    """Window replacement (the native DALI policy): its window (tokens) and update (experts swapped per
    window); 0, or -1 if refused."""
    return int(_moe_cache_set_window_replacement(ctx, window, update))


# int32_t llama_moe_cache_set_prompt_swap(struct llama_context * ctx, double threshold);
_moe_cache_set_prompt_swap = declare(
    "llama_moe_cache_set_prompt_swap", [ctypes.c_void_p, ctypes.c_double], ctypes.c_int32
)


def moe_cache_set_prompt_swap(ctx: LlamaContext, threshold: float) -> int:
    """Prompt swap (the native DAOP policy): its swap threshold (SwapInOut); 0, or -1 if refused (below 1)."""
    return int(_moe_cache_set_prompt_swap(ctx, threshold))


# int32_t llama_moe_cache_set_predicted_prefetch(struct llama_context * ctx, bool blocking,
#                                                double admit_bytes);
_moe_cache_set_predicted_prefetch = declare(
    "llama_moe_cache_set_predicted_prefetch",
    [ctypes.c_void_p, ctypes.c_bool, ctypes.c_double],
    ctypes.c_int32,
)


def moe_cache_set_predicted_prefetch(ctx: LlamaContext, blocking: bool, admit_bytes: float) -> int:
    """Predicted prefetch (the native ProMoE policy): blocking misses; admit_bytes, the bytes the copy stream
    moves per MoE layer time (0: admit every load); 0 on success."""
    return int(_moe_cache_set_predicted_prefetch(ctx, blocking, admit_bytes))


# struct llama_moe_prefetch_stats llama_moe_cache_get_prefetch_stats(const struct llama_context * ctx);
_moe_cache_get_prefetch_stats = declare(
    "llama_moe_cache_get_prefetch_stats", [ctypes.c_void_p], MoePrefetchStats
)


def moe_cache_prefetch_stats(ctx: LlamaContext) -> dict[str, int]:
    s = _moe_cache_get_prefetch_stats(ctx)
    return {name: int(getattr(s, name)) for name, *_ in MoePrefetchStats._fields_}


# int32_t llama_moe_cache_set_staging(struct llama_context * ctx, int32_t n_buffers, bool any_host);
_moe_cache_set_staging = declare(
    "llama_moe_cache_set_staging", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool], ctypes.c_int32
)


def moe_cache_set_staging(ctx: LlamaContext, n_buffers: int, any_host: bool = False) -> int:
    """Send the cache's loads from n_buffers staging buffers in the device's host memory (pinned on CUDA; the
    library's default is 4; 0: from the mapped file); any_host: plain host memory where the device has no host
    buffer type (RPC: for tests). 0, or -1 if refused."""
    return int(_moe_cache_set_staging(ctx, n_buffers, any_host))


# enum llama_moe_prefill_ahead: what a prefill ubatch copies one cached layer ahead
MOE_PREFILL_ROUTED = 0  # nothing ahead: each layer copies the experts it routes at its routing callback
MOE_PREFILL_ALL = 1  # the next cached layer's experts outside its slots
MOE_PREFILL_PREDICTED = 2  # those the in-graph predictor from this layer names (ALL where there is none)
MOE_PREFILL_AHEAD = {"routed": MOE_PREFILL_ROUTED, "all": MOE_PREFILL_ALL, "predicted": MOE_PREFILL_PREDICTED}


# int32_t llama_moe_cache_set_prefill(struct llama_context * ctx, int32_t n_min_tokens, enum llama_moe_prefill_ahead ahead);
_moe_cache_set_prefill = declare(
    "llama_moe_cache_set_prefill", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int], ctypes.c_int32
)
# struct llama_moe_prefill_stats llama_moe_cache_get_prefill_stats(const struct llama_context * ctx);
_moe_cache_get_prefill_stats = declare(
    "llama_moe_cache_get_prefill_stats", [ctypes.c_void_p], MoePrefillStats
)


def moe_cache_set_prefill(ctx: LlamaContext, n_min_tokens: int, ahead: int = MOE_PREFILL_ALL) -> int:
    """Ubatches of n_min_tokens+ tokens run each cached layer's other experts on the cache's device from two
    prefill buffers, copied one cached layer ahead (0: off). 0; -1 without a cache or for n < 0; -2 when the
    buffers cannot be allocated."""
    return int(_moe_cache_set_prefill(ctx, n_min_tokens, ahead))


def moe_cache_prefill_stats(ctx: LlamaContext) -> dict[str, int]:
    s = _moe_cache_get_prefill_stats(ctx)
    return {name: int(getattr(s, name)) for name, *_ in MoePrefillStats._fields_}


# int32_t llama_moe_cache_set_prefill_borrow(struct llama_context * ctx, bool borrow);
_moe_cache_set_prefill_borrow = declare(
    "llama_moe_cache_set_prefill_borrow", [ctypes.c_void_p, ctypes.c_bool], ctypes.c_int32
)
# int32_t llama_moe_cache_prefill_return(struct llama_context * ctx);
_moe_cache_prefill_return = declare("llama_moe_cache_prefill_return", [ctypes.c_void_p], ctypes.c_int32)
# struct llama_moe_borrow_stats llama_moe_cache_get_borrow_stats(const struct llama_context * ctx);
_moe_cache_get_borrow_stats = declare("llama_moe_cache_get_borrow_stats", [ctypes.c_void_p], MoeBorrowStats)


def moe_cache_set_prefill_borrow(ctx: LlamaContext, borrow: bool) -> int:
    """The prefill buffers lie over the slots of the last cached layers, lent from a prefill's first ubatch to
    its end and then refilled with the experts it routed most, instead of an allocation of their own. What
    moe_cache_set_prefill returns; -3 when the cached layers' slots cannot hold the two buffers."""
    return int(_moe_cache_set_prefill_borrow(ctx, borrow))


def moe_cache_prefill_return(ctx: LlamaContext) -> int:
    """Give the lent slots back now and queue their refill: the experts queued (0: none lent, -1: no cache)."""
    return int(_moe_cache_prefill_return(ctx))


def moe_cache_borrow_stats(ctx: LlamaContext) -> dict[str, int]:
    s = _moe_cache_get_borrow_stats(ctx)
    return {name: int(getattr(s, name)) for name, *_ in MoeBorrowStats._fields_}


# int32_t llama_moe_cache_set_precalc(struct llama_context * ctx, int32_t il_first, int32_t n_max_tokens);
_moe_cache_set_precalc = declare(
    "llama_moe_cache_set_precalc", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32
)
# struct llama_moe_precalc_stats llama_moe_cache_get_precalc_stats(const struct llama_context * ctx);
_moe_cache_get_precalc_stats = declare(
    "llama_moe_cache_get_precalc_stats", [ctypes.c_void_p], MoePrecalcStats
)


def moe_cache_set_precalc(ctx: LlamaContext, il_first: int, n_max_tokens: int) -> int:
    """DAOP's pre-calculation in ubatches of at most n_max_tokens tokens: each cached layer il >= il_first takes
    its predicted experts outside the slots from the MoE layer before, computed there on that layer's input
    (il_first < 0 or n_max_tokens 0: off). 0; -1 without a cache or for n_max_tokens < 0."""
    return int(_moe_cache_set_precalc(ctx, il_first, n_max_tokens))


def moe_cache_precalc_stats(ctx: LlamaContext) -> dict[str, int]:
    s = _moe_cache_get_precalc_stats(ctx)
    return {name: int(getattr(s, name)) for name, *_ in MoePrecalcStats._fields_}


# void llama_moe_cache_set_async(struct llama_context * ctx, bool async);
_moe_cache_set_async = declare("llama_moe_cache_set_async", [ctypes.c_void_p, ctypes.c_bool], None)


def moe_cache_set_async(ctx: LlamaContext, on: bool) -> None:
    """Issue the cache's queued loads from llama.cpp's load worker thread (on a device with events) or,
    off, from the caller's thread when it issues them or synchronises."""
    _moe_cache_set_async(ctx, on)


def moe_cache_init(ctx: LlamaContext, n_slots: list[int] | None, device: GgmlDevice | None = None) -> int:
    """Give each layer n_slots[il] expert slots on device (None: the CPU stand-in); None removes the cache."""
    if _moe_cache_init is None:
        missing_native()
    arr = (ctypes.c_int32 * len(n_slots))(*n_slots) if n_slots is not None else None
    return int(_moe_cache_init(ctx, device, arr))


def moe_cache_set_source(ctx: LlamaContext, layer: int, pointers: list[int | None]) -> bool:
    """Where loads of the layer read: addresses of its stacked expert tensors' bytes (None: absent), in the
    order of expert_cache.EXPERT_TENSORS (gate_up, up, gate, down, their biases, the scales)."""
    if len(pointers) != MOE_CACHE_N_SOURCES:
        raise ValueError(f"{len(pointers)} sources, llama_moe_cache_set_source takes {MOE_CACHE_N_SOURCES}")
    arr = (ctypes.c_void_p * MOE_CACHE_N_SOURCES)(*pointers)
    return bool(_moe_cache_set_source(ctx, layer, arr))


def moe_cache_load(ctx: LlamaContext, layer: int, expert: int, slot: int) -> bool:
    """Copy expert into slot (expert -1 only evicts)."""
    return bool(_moe_cache_load(ctx, layer, expert, slot))


def moe_cache_slots(ctx: LlamaContext, layer: int, n_expert: int) -> list[int] | None:
    """The slot of each expert of the layer (-1: not resident), None when the layer has no slots."""
    p = _moe_cache_slots(ctx, layer)
    return [int(p[i]) for i in range(n_expert)] if p else None


def moe_cache_prefetch(ctx: LlamaContext, layer: int, expert: int, slot: int, priority: int = 0) -> bool:
    """Queue an asynchronous load (evicts the slot's expert now)."""
    return bool(_moe_cache_prefetch(ctx, layer, expert, slot, priority))


def moe_cache_issue_loads(ctx: LlamaContext, max_chunks: int = 2**31 - 1) -> int:
    """Issue up to max_chunks queued chunks, most urgent first; returns how many."""
    return int(_moe_cache_issue_loads(ctx, max_chunks))


def moe_cache_sync(ctx: LlamaContext) -> None:
    """Wait for the issued loads; they become resident."""
    _moe_cache_sync(ctx)


def moe_cache_state(ctx: LlamaContext, layer: int, expert: int) -> int:
    return int(_moe_cache_get_state(ctx, layer, expert))


def moe_cache_stats(ctx: LlamaContext) -> MoeCacheStats:
    return _moe_cache_get_stats(ctx)


def moe_cache_reset_stats(ctx: LlamaContext) -> None:
    _moe_cache_reset_stats(ctx)


def moe_cache_set_step(ctx: LlamaContext, step: str, params: tuple[float, ...]) -> int:
    """Set the parameters of the native step `step` (a key of MOE_CACHE_STEPS) before llama_moe_cache_set_policy
    selects it: window replacement's (window, update), prompt swap's (threshold,); the others take none. 0, or
    -1 if refused."""
    if step == "window_replacement":
        window, update = params
        return moe_cache_set_window_replacement(ctx, int(window), int(update))
    if step == "prompt_swap":
        return moe_cache_set_prompt_swap(ctx, float(params[0]))
    return 0
