"""The one native boundary: loads llama-cpp-python's library and declares edgemoe's C API.

Every ctypes declaration for functions added by patches/ lives here, each with
its C prototype quoted. The rest of edgemoe imports ``lib`` (llama_cpp's
low-level module) and the typed wrappers below; nothing else touches ctypes
function declarations.
"""
from __future__ import annotations

import ctypes
import logging
from collections import deque
from typing import Any

from .errors import NativeLibraryError

# The patch level this edgemoe needs (patches/series: 0001 sets 1, 0002 sets 2).
REQUIRED_PATCH_LEVEL = 3

log = logging.getLogger(__name__)

try:
    import llama_cpp.llama_cpp as lib  # low-level bindings; we never use the high-level Llama class
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    raise NativeLibraryError(
        f"llama-cpp-python is not importable ({err}); run `make install` to build the patched "
        "llama.cpp into .venv") from err

_cdll: ctypes.CDLL = lib._lib


def _declare(name: str, argtypes: list[Any], restype: Any) -> Any:
    fn = getattr(_cdll, name, None)
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


@lib.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - native
    if level in _LOG_LEVELS:
        _level[0] = _LOG_LEVELS[level]
    _partial.append(text.decode("utf-8", errors="replace"))
    if _partial[-1].endswith("\n"):
        line = "".join(_partial).rstrip()
        _partial.clear()
        _recent.append(line)
        _llama_log.log(_level[0], "%s", line)


def route_logs_to_python() -> None:
    lib.llama_log_set(_log_callback, ctypes.c_void_p(0))


def recent_log() -> str:
    """The last llama.cpp log lines (for error messages when a load fails)."""
    return "\n".join(_recent)
