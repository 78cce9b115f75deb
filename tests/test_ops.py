"""Op-level tests of the patched ggml, built against the installed libggml.

tests/native/test_mmid_skip.cpp checks skipped ids (mul_mat_id / add_id skip slots with id < 0) on every
backend the library has: CPU, the CPU repack buffer, and CUDA when built with it. The series also adds
the ops' cases to llama.cpp's own tests/test-backend-ops.cpp, which compares a backend with the CPU.

Headers and test-backend-ops come from the installed package (tools/build_llama.py puts them in the venv's
edgemoe.runtime.op_tests.NATIVE_TOOLS_DIR), else from the patched tree under .build/.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers.native_ops import LLAMA_SRC, build_native, run_backend_ops
from helpers.rpc_server import rpc_server


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


def test_backend_ops_cases_of_the_series_run_on_the_cpu(tmp_path: Path) -> None:
    """The series' test-backend-ops cases (skipped ids, moe_gate) build against the installed library and run.

    On the CPU they compare the CPU backend with itself, so what they can catch here is a crash, a NaN, a write
    outside an output (test-backend-ops' sentinels) or a missing case; the comparison that matters runs on a
    CUDA build (tests/test_gpu.py). The properties the CPU comparison cannot see (skipped rows exactly 0,
    decisions equal to the Python rules) are the standalone programs' above.
    """
    run_backend_ops(tmp_path, "CPU")


def test_backend_ops_cases_of_the_series_run_on_the_rpc_device(tmp_path: Path) -> None:
    """The same cases on a device behind llama.cpp's RPC server (test-backend-ops --rpc, a patch of the series): the
    stand-in for a GPU compared with the CPU backend, the -1 ids carried over the protocol to the server's kernels."""
    with rpc_server() as endpoint:
        out = run_backend_ops(tmp_path, "RPC0", rpc=endpoint)
    assert f"Backend RPC0[{endpoint}]" in out, out[-2000:]  # the cases ran on the server's device


def test_a_host_buffer_no_device_computes_on_is_the_cpus(tmp_path: Path) -> None:
    """llm_moe_buft_is_device (llama-moe-graph.h): a branch whose experts sit in a device's host buffer that its
    backend does not compute on (CUDA_Host, pinned: the layers past -ngl) is the CPU's branch, not the device's
    (which would hand the CPU the spare rows and move the masked product to the GPU). The truth table, then real
    buffer types: the RPC device's own buffer (a device's) and the CPU's buffer seen from the RPC device (a host
    buffer it does not compute on)."""
    exe = build_native("test_moe_device_class", tmp_path, extra_include=[LLAMA_SRC / "include", LLAMA_SRC / "src"])
    with rpc_server() as endpoint:
        proc = subprocess.run([str(exe), endpoint], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rpc buffer: device" in proc.stdout and "cpu buffer on rpc: cpu" in proc.stdout, proc.stdout
