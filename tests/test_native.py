"""The native boundary: edgemoe runs only on the patched llama.cpp."""
from __future__ import annotations

import pytest

from edgemoe.errors import NativeLibraryError
from edgemoe.runtime import native


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


def test_every_struct_mirror_has_the_librarys_size() -> None:
    """Each ctypes mirror of a C struct (edgemoe.runtime.native.structs) is as large as the library says the struct is
    (llama_edgemoe_struct_size): a field added, dropped or retyped on either side fails here, not as garbage."""
    import ctypes

    from edgemoe.runtime.native import structs

    assert structs.size_mismatches() == {}
    assert all(structs.library_size(name) == ctypes.sizeof(m) > 0 for name, m in structs.MIRRORS.items())
    assert structs.library_size("no_such_struct") == 0
    # every ctypes.Structure the package declares is a mirror in that one module
    import ast
    from pathlib import Path

    pkg = Path(structs.__file__).resolve().parents[2]
    declared = {
        (path.relative_to(pkg).as_posix(), node.name)
        for path in pkg.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "ctypes.Structure" for b in node.bases)
    }
    assert {f for f, _ in declared} == {"runtime/native/structs.py"}, declared
    assert {n for _, n in declared} == {m.__name__ for m in structs.MIRRORS.values()}
