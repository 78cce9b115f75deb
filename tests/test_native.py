"""The native boundary: edgemoe runs only on the patched llama.cpp."""
from __future__ import annotations

import pytest

from edgemoe.runtime import native
from edgemoe.errors import NativeLibraryError


def test_patched_library_is_loaded() -> None:
    # fails on a stock llama-cpp-python: the symbol comes from patches/0001
    assert native.patch_level() >= native.REQUIRED_PATCH_LEVEL
    native.require_patched()


def test_stock_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemoe.runtime.native import loader

    monkeypatch.setattr(loader, "_patch_level", None)  # what a stock libllama looks like
    assert native.patch_level() == 0
    with pytest.raises(NativeLibraryError, match="make install"):
        native.require_patched()


def test_system_info_reports_cpu() -> None:
    assert "CPU" in native.system_info()


def test_native_abort_is_one_line_and_never_runs_a_debugger() -> None:
    """ggml's abort path would run gdb for a backtrace (minutes, or a hang); edgemoe prints one line."""
    import subprocess
    import sys

    code = ("import ctypes\nfrom edgemoe.runtime import native\n"
            "ctypes.CDLL('libggml-base.so.0').ggml_abort(b'ops.cpp', ctypes.c_int(7), b'%s', b'GGML_ASSERT(x) failed')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "EDGEMOE_DEBUG": ""})
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("edgemoe: llama.cpp stopped on an internal error: ops.cpp:7: GGML_ASSERT(x) failed")
