"""Native test programs built against the installed libggml: tests/native/*.cpp and llama.cpp's test-backend-ops.

Headers and test-backend-ops come from the installed package (tools/build_llama.py puts them in the venv's
edgemoe.runtime.op_tests.NATIVE_TOOLS_DIR), else from the patched tree under .build/.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import llama_cpp

from edgemoe.runtime.op_tests import BACKEND_OPS_NAME, SERIES_CASES, installed_include_dir, native_tools_dir

from helpers.models import ROOT

NATIVE = ROOT / "tests" / "native"
LLAMA_SRC = ROOT / ".build" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
# the installed package's headers, else the build tree's
GGML_INCLUDE = next((d for d in (installed_include_dir(), LLAMA_SRC / "ggml" / "include") if (d / "ggml.h").exists()),
                    LLAMA_SRC / "ggml" / "include")
INSTALLED_BACKEND_OPS = native_tools_dir() / BACKEND_OPS_NAME
BACKEND_OPS_CASES = SERIES_CASES
LIB_DIR = Path(llama_cpp.__file__).parent / "lib"


def build_native(name: str, out_dir: Path, source: Path | None = None, extra_include: list[Path] | None = None) -> Path:
    """Compile tests/native/<name>.cpp (or source) against the patched headers (and extra_include) and the venv's
    libggml."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed for the op tests"
    assert (GGML_INCLUDE / "ggml.h").exists(), f"no ggml.h in {installed_include_dir()} or {GGML_INCLUDE}: run `make install`"
    exe = out_dir / name
    src = source or NATIVE / f"{name}.cpp"
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", str(src), f"-I{GGML_INCLUDE}", *(f"-I{d}" for d in extra_include or []),
           f"-L{LIB_DIR}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{LIB_DIR}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def backend_ops_exe(out_dir: Path) -> Path:
    """The installed test-backend-ops, else one built into out_dir from the patched tree under .build/."""
    if INSTALLED_BACKEND_OPS.exists():
        return INSTALLED_BACKEND_OPS
    return build_native("test-backend-ops", out_dir, LLAMA_SRC / "tests" / "test-backend-ops.cpp")


def run_backend_ops(out_dir: Path, backend: str, rpc: str | None = None) -> str:
    """llama.cpp's test-backend-ops of the patched tree (installed, or built into out_dir) run on one backend (rpc:
    an RPC server's HOST:PORT) with the series' cases only; its output (asserted to pass)."""
    exe = backend_ops_exe(out_dir)
    ops = ",".join(BACKEND_OPS_CASES)
    cmd = [str(exe), "-b", backend, "-o", ops, *(["--rpc", rpc] if rpc else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    n_cases = sum(BACKEND_OPS_CASES.values())
    assert f"{n_cases}/{n_cases} tests passed" in proc.stdout, proc.stdout[-3000:]
    for op in BACKEND_OPS_CASES:
        assert f"  {op}(" in proc.stdout, op
    return proc.stdout
