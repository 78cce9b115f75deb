"""Loading libllama (llama-cpp-python's copy) and its ggml siblings once, the patch-level handshake, and
llama.cpp's logs and aborts routed to Python.

Before libllama is loaded, the C++ runtime guard reads the libraries beside it: if one carries its own copy of
the C++ runtime, the system libstdc++.so.6 is loaded globally first (`cxx_runtime_guard` records what it did,
for doctor)."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType, NoReturn

from ...errors import NativeLibraryError
from . import elf

# The patch level this edgemoe needs: set once by the series' first patch (patches/README.md); raise it with
# the C side when the API these bindings use changes.
REQUIRED_PATCH_LEVEL = 30

log = logging.getLogger(__name__)


# -- the C++ runtime guard (docs/build.md, "The C++ runtime") ------------------------------------------
@dataclass(frozen=True)
class CxxRuntimeGuard:
    """What the guard found before libllama was loaded (doctor reports it)."""

    # llama_cpp's library directory (LLAMA_CPP_LIB_PATH or the package's lib/); None: not found
    lib_dir: Path | None
    offenders: tuple[str, ...]  # libraries there that define and export a copy of the C++ runtime
    preloaded: str | None  # the system libstdc++.so.6 loaded globally because of them (its path when known)
    too_late: bool  # llama_cpp's bindings were imported before the guard ran: a preload could not help


def llama_lib_dir() -> Path | None:
    """The directory llama-cpp-python loads libllama from, found without importing its bindings."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")  # the package's location; nothing of it is executed
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) / "lib" if locations else None


def _mapped_path(soname: str) -> str | None:
    """The file of a loaded library whose name starts with soname, from /proc/self/maps (None elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split()[-1] for ln in lines if Path(ln.split()[-1]).name.startswith(soname)), None)


def guard_cxx_runtime(lib_dir: Path | None) -> CxxRuntimeGuard:
    """If a library in lib_dir exports its own copy of the C++ runtime (a static libstdc++ linked into a CUDA
    build), load the system libstdc++.so.6 globally first, so that libllama and the ggml libraries bind to it
    rather than to that copy (which crashed every model load on a GPU). A few ms: only the dynamic symbols
    that can be the runtime's are decoded."""
    too_late = "llama_cpp.llama_cpp" in sys.modules
    offenders: list[str] = []
    for path in elf.library_files(lib_dir) if lib_dir is not None and lib_dir.is_dir() else []:
        try:
            if elf.exported_runtime(path):
                offenders.append(path.name)
        except (elf.ElfError, OSError) as err:
            log.debug("C++ runtime guard: cannot read %s: %s", path, err)
    if not offenders:
        return CxxRuntimeGuard(lib_dir, (), None, too_late)
    preloaded = None
    try:
        ctypes.CDLL(elf.CXX_RUNTIME_SONAME, mode=ctypes.RTLD_GLOBAL)
        preloaded = _mapped_path(elf.CXX_RUNTIME_SONAME) or elf.CXX_RUNTIME_SONAME
        done = f"loaded {preloaded} globally first, so that libllama binds to it"
    except OSError as err:
        done = f"could not load {elf.CXX_RUNTIME_SONAME} globally first ({err})"
    log.warning(
        "%s in %s define%s and export%s a copy of the C++ runtime; %s%s. Rebuild to fix it: `make install` "
        "(EDGEMOE_CUDA=1 for CUDA), docs/build.md 'The C++ runtime'",
        ", ".join(offenders),
        lib_dir,
        *(("s", "s") if len(offenders) == 1 else ("", "")),
        done,
        " (too late: llama_cpp was imported before edgemoe)" if too_late else "",
    )
    return CxxRuntimeGuard(lib_dir, tuple(offenders), preloaded, too_late)


# before the import below loads libllama and its ggml libraries
cxx_runtime_guard = guard_cxx_runtime(llama_lib_dir())

try:
    import llama_cpp.llama_cpp as lib  # low-level bindings; we never use the high-level Llama class
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    raise NativeLibraryError(
        f"llama-cpp-python is not importable ({err}); run `make install` to build the patched "
        "llama.cpp into .venv"
    ) from err

_cdll: ctypes.CDLL = lib._lib

# the handles edgemoe passes across the boundary
LlamaContext = lib.llama_context_p  # struct llama_context * (llama-cpp-python's handle type)
GgmlDevice = NewType("GgmlDevice", int)  # ggml_backend_dev_t
GgmlBufferType = NewType("GgmlBufferType", int)  # ggml_backend_buffer_type_t


def declare(name: str, argtypes: list[Any], restype: Any, dll: ctypes.CDLL | None = None) -> Any:
    """Declare a function of libllama (or of dll); None when the library lacks it."""
    fn = getattr(dll if dll is not None else _cdll, name, None)
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


# int32_t llama_edgemoe_patch_level(void);
_patch_level = declare("llama_edgemoe_patch_level", [], ctypes.c_int32)


def _sibling(soname: str) -> ctypes.CDLL | None:
    """The copy libllama itself loaded: by soname (pip installs libggml.so and libggml.so.0 as two
    files, and a second copy would have a registry of devices of its own)."""
    try:
        return ctypes.CDLL(soname)  # already loaded as libllama's dependency: the same object
    except OSError:
        return None


ggml_lib = _sibling("libggml.so.0")
ggml_cpu_lib = _sibling("libggml-cpu.so.0")
ggml_base_lib = _sibling("libggml-base.so.0")


def library_path() -> str:
    """The path of the libllama this process loaded."""
    return str(getattr(_cdll, "_name", ""))


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
            "run `make install` (or `python tools/build_llama.py`) to build the patched library"
        )


def require_ggml_functions(*fns: Any, caller: str) -> None:
    """Raise NativeLibraryError unless every declared ggml function was found (declare() gives None for one the
    libraries beside libllama lack); `caller` names what needs them."""
    if any(fn is None for fn in fns):
        raise NativeLibraryError(
            f"the ggml libraries beside libllama lack a function {caller} calls (a stock or partial build?): "
            "run `make install`"
        )


def missing_native() -> NoReturn:
    """Raise for a patched function the loaded libllama lacks (NativeLibraryError of require_patched on stock)."""
    require_patched()
    raise NativeLibraryError(
        "the loaded libllama lacks a function of edgemoe's patch series: run `make install` to rebuild it"
    )


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
_captures: list[list[str]] = []  # the lists of open captured_log() blocks


@lib.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - native
    if level in _LOG_LEVELS:
        _level[0] = _LOG_LEVELS[level]
    _partial.append(text.decode("utf-8", errors="replace"))
    if _partial[-1].endswith("\n"):
        line = "".join(_partial).rstrip()
        _partial.clear()
        _recent.append(line)
        for lines in _captures:
            lines.append(line)
        _n_lines[0] += 1
        if _level[0] >= logging.ERROR:
            _errors.append((_n_lines[0], line))
        _llama_log.log(_level[0], "%s", line)


# -- native aborts: one line, no debugger --------------------------------------------------------------
# ggml's abort path runs gdb/lldb for a backtrace when one is installed, which can hang a process
# for minutes; GGML_NO_BACKTRACE (read at abort time) turns that off unless edgemoe runs with --debug.
# typedef void (*ggml_abort_callback_t)(const char * error_message);
_AbortCallback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
# ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback);
_set_abort_callback = declare("ggml_set_abort_callback", [_AbortCallback], ctypes.c_void_p, ggml_base_lib)
_backtrace_env_set = [False]


@_AbortCallback
def _on_native_abort(message: bytes | None) -> None:  # pragma: no cover - runs in a dying process
    text = (message or b"").decode("utf-8", errors="replace").strip()
    os.write(
        2,
        f"edgemoe: llama.cpp stopped on an internal error: {text} (a bug: please report it with the "
        "command; `edgemoe --debug` shows a native backtrace)\n".encode(),
    )


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


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Every llama.cpp log line logged inside the block, in a list the block can read after the call that logs
    them (a context's creation logs hundreds of lines: its KV cache, what flash attention resolved to)."""
    lines: list[str] = []
    _captures.append(lines)
    try:
        yield lines
    finally:
        _captures.remove(lines)


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
