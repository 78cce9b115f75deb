"""Op-level tests of the patched ggml (tests/native/*.cpp), built against the installed libggml.

test_mmid_skip.cpp checks patch 0003 (mul_mat_id / add_id skip slots with id < 0) on every
backend the library has: CPU, the CPU repack buffer, and CUDA when built with it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import llama_cpp

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "tests" / "native"
GGML_INCLUDE = ROOT / ".build" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "ggml" / "include"
LIB_DIR = Path(llama_cpp.__file__).parent / "lib"


def build_native(name: str, out_dir: Path) -> Path:
    """Compile tests/native/<name>.cpp against the patched headers and the venv's libggml."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed for the op tests"
    assert (GGML_INCLUDE / "ggml.h").exists(), f"{GGML_INCLUDE} missing: run `make install` first"
    exe = out_dir / name
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", str(NATIVE / f"{name}.cpp"), f"-I{GGML_INCLUDE}",
           f"-L{LIB_DIR}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{LIB_DIR}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


@pytest.fixture(scope="module")
def mmid_skip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_native("test_mmid_skip", tmp_path_factory.mktemp("native"))


@pytest.mark.parametrize("threads", [1, 3])
def test_mul_mat_id_and_add_id_skip_negative_ids(mmid_skip: Path, threads: int) -> None:
    proc = subprocess.run([str(mmid_skip), str(threads)], capture_output=True, text=True, timeout=600)
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0, "\n".join(failed) or proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"summary: (\d+) cases, (\d+) failed", proc.stdout)
    assert m and m.group(2) == "0"
    # 6 types x 4 token counts x 3 skip rates + 2 on the plain CPU buffer alone
    assert int(m.group(1)) >= 74
    assert "OK   CPU [type=q4_K" in proc.stdout and "p_skip=1.00" in proc.stdout
