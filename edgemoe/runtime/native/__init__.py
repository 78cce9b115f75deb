"""The native boundary: libllama as llama-cpp-python loads it, and the C API of edgemoe's patch series.

- loader: the library, its ggml siblings (each loaded once, by soname), the patch-level handshake, logs and aborts;
- llama_moe: the llama_moe_* functions (include/llama.h of the patched tree), each under its C prototype;
- ggml: devices, buffer types, type ids and the RPC stand-in device.

The microbenchmarks' ggml graph bindings live beside them, in edgemoe.perf.ggml_graph. Callers use
`from edgemoe.runtime import native` and `native.NAME`; tests monkeypatch the same names."""
from __future__ import annotations

from .loader import (  # noqa: F401
    lib, LlamaContext, GgmlDevice, GgmlBufferType, REQUIRED_PATCH_LEVEL, patch_level, require_patched,
    supports_gpu_offload, system_info, set_native_debug, route_logs_to_python, recent_log, log_mark, recent_error
)
from .llama_moe import (  # noqa: F401
    MOE_HOOK_PROBS, MOE_HOOK_GATE_INP, MoeRoute, MoeHookFn, moe_set_hook, MoeCacheStats, MOE_CACHE_ABSENT,
    MOE_CACHE_QUEUED, MOE_CACHE_COPYING, MOE_CACHE_RESIDENT, MOE_CACHE_N_SOURCES, MOE_GATING_NONE,
    MOE_GATING_SCORE, MOE_GATING_SER, MOE_GATING_SENSITIVITY, MoeStats, moe_set_gating, moe_stats,
    moe_reset_stats, moe_set_predictor, moe_clear_predictors, moe_get_predictions, moe_predictor_bytes,
    MOE_CACHE_POLICY_CALLBACK, MOE_CACHE_POLICY_MANUAL, MOE_CACHE_POLICY_LRU, MOE_CACHE_POLICY_DALI,
    MOE_CACHE_POLICY_DAOP, MOE_CACHE_POLICY_PROMOE, moe_cache_set_policy, moe_cache_set_overlap,
    moe_cache_set_dali, moe_cache_set_daop, moe_cache_set_promoe, MoePrefetchStats, moe_cache_prefetch_stats,
    moe_cache_set_staging, MOE_PREFILL_ROUTED, MOE_PREFILL_ALL, MOE_PREFILL_PREDICTED, MOE_PREFILL_AHEAD,
    MoePrefillStats, moe_cache_set_prefill, moe_cache_prefill_stats, MoePrecalcStats, moe_cache_set_precalc,
    moe_cache_precalc_stats, moe_cache_set_async, moe_cache_init, moe_cache_set_source, moe_cache_load,
    moe_cache_slots, moe_cache_prefetch, moe_cache_issue, moe_cache_sync, moe_cache_state, moe_cache_stats,
    moe_cache_reset_stats, _moe_get_predictions
)
from .ggml import (  # noqa: F401
    GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, device_by_type, reg_proc_address,
    cpu_buffer_type, gpu_device, device_name, device_memory, rpc_loopback_device, TensorBuftOverride,
    cpu_overrides, GGML_TYPES, GGML_TYPE_F32, GGML_TYPE_I32, GGML_TYPE_I8
)
