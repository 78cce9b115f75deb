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

from ..errors import NativeLibraryError

# The patch level this edgemoe needs (patches/series: 0001 sets 1, 0002 sets 2, 0004 sets 3, 0005 sets 4,
# 0006 sets 5, 0007 sets 6, 0009 sets 7, 0010 sets 8, 0011 sets 9, 0012 sets 10, 0013 sets 11).
REQUIRED_PATCH_LEVEL = 11

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
# int32_t llama_moe_cache_issue(struct llama_context * ctx, int32_t max_chunks);
_moe_cache_issue = _declare("llama_moe_cache_issue", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
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


# enum llama_moe_cache_policy
MOE_CACHE_POLICY_CALLBACK = 0  # the routing callback maps each cached layer's ids (a host sync per layer)
MOE_CACHE_POLICY_MANUAL = 1  # expert-to-slot tables in the graph; only load/prefetch change them
MOE_CACHE_POLICY_LRU = 2  # tables in the graph; a native per-layer LRU after each ubatch

# int32_t llama_moe_cache_set_policy(struct llama_context * ctx, enum llama_moe_cache_policy policy);
_moe_cache_set_policy = _declare("llama_moe_cache_set_policy", [ctypes.c_void_p, ctypes.c_int], ctypes.c_int32)


def moe_cache_set_policy(ctx: Any, policy: int) -> int:
    return int(_moe_cache_set_policy(ctx, policy))


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


def moe_cache_issue(ctx: Any, max_chunks: int = 2**31 - 1) -> int:
    """Issue up to max_chunks queued chunks, most urgent first; returns how many."""
    return int(_moe_cache_issue(ctx, max_chunks))


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


def rpc_loopback_device(port: int, n_threads: int = 1) -> int:
    """Start llama.cpp's RPC server on 127.0.0.1:port in this process (serving the CPU backend from a
    daemon thread), register it, and return its device: a GPU-type device with its own buffers, async
    copies and events, reached over loopback. For tests of the cache's device paths without a GPU.
    Every model loaded afterwards in this process sees the device (run it in a process of its own).
    """
    import threading
    import time

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
