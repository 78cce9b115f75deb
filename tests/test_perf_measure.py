"""Machine microbenchmarks through ggml (edgemoe.perf.measure.microbench), the inputs of `edgemoe profile`.

The machine may be shared and loaded: timing comparisons use threads=1 (a 2-thread ggml barrier on a
busy 2-core machine waits for the scheduler, which says nothing about the op) and margins far below
what the work itself implies.
"""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgemoe.errors import EdgeMoeError
from edgemoe.perf.measure import ggml_graph, microbench

ROOT = Path(__file__).resolve().parent.parent


def _x86_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _ok(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0


def _rss_bytes() -> int:
    import os
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_types_listed_and_bad_arguments_say_what_to_do() -> None:
    types = microbench.quant_types_supported()
    for name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4", "F16", "F32"):
        assert name in types
    with pytest.raises(EdgeMoeError, match="Q4_K"):  # the message lists the supported types
        microbench.time_expert_ffn("Q7_Z", 256, 256, [1], threads=1)
    with pytest.raises(EdgeMoeError, match="multiple of 256"):
        microbench.time_expert_ffn("Q4_K", 1000, 256, [1], threads=1)
    with pytest.raises(EdgeMoeError, match="token counts"):
        microbench.time_matmul("Q8_0", 256, 256, [0], threads=1)
    with pytest.raises(EdgeMoeError, match="threads"):
        microbench.time_matmul("Q8_0", 256, 256, [1], threads=0)


# ggml builds the IQ1/IQ2 quantization grids on first use: seconds each, so those run with -m slow
_SLOW_TYPES = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}


@pytest.mark.parametrize("qtype", [pytest.param(q, marks=pytest.mark.slow) if q in _SLOW_TYPES else q
                                   for q in microbench.quant_types_supported()])
def test_every_listed_type_computes(qtype: str) -> None:
    t = microbench.time_matmul(qtype, 256, 64, [1, 4], threads=1, cold=False, min_seconds=0.002)
    assert set(t) == {1, 4} and all(_ok(v) for v in t.values()), t


def test_expert_ffn_time_grows_with_tokens_and_size() -> None:
    small = microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 256], threads=1, cold=False)
    assert all(_ok(v) for v in small.values()), small
    # 256 tokens are 256 times the multiply-adds of one (the weights are read once either way)
    assert small[256] > 4 * small[1], small
    # 8x the weights and the work at one token: a graph that skipped the op would not notice
    big = microbench.time_expert_ffn("Q4_K", 4096, 1024, [1], threads=1, cold=False)
    assert big[1] > 2 * small[1], (small, big)
    assert small.backend == "CPU" and small.pool == 1 and small.pool_bytes > 0


def test_repack_buffer_is_chosen_when_it_takes_the_type() -> None:
    repacked = microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 32], threads=1, cold=False, repack=True)
    plain = microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 32], threads=1, cold=False, repack=False)
    assert plain.buffer_type == "CPU"
    assert all(_ok(v) for v in (*repacked.values(), *plain.values())), (repacked, plain)
    if _x86_avx2():  # q4_K_8x8 (ggml/src/ggml-cpu/repack.cpp)
        assert repacked.buffer_type == "CPU_REPACK"
        # the repack type takes no Q6_K on x86, nor a Q4_K matrix whose rows are not a multiple of 8
        assert microbench.time_matmul("Q6_K", 512, 64, [1], threads=1, cold=False, min_seconds=0.002) \
            .buffer_type == "CPU"
        assert microbench.time_matmul("Q4_K", 512, 60, [1], threads=1, cold=False, min_seconds=0.002) \
            .buffer_type == "CPU"
        assert microbench.time_matmul("Q4_K", 512, 64, [1], threads=1, cold=False, min_seconds=0.002) \
            .buffer_type == "CPU_REPACK"
    else:
        assert repacked.buffer_type in ("CPU_REPACK", "CPU")


def test_two_threads_run() -> None:
    t = microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 64], threads=2, cold=False, min_seconds=0.01)
    assert all(_ok(v) for v in t.values()), t
    assert _ok(microbench.time_graph_node(threads=2, n_nodes=32, runs=5, max_seconds=0.5))


def test_cold_is_not_faster_than_hot() -> None:
    # 9 MiB, far above L2: hot it stays in the last-level cache, cold every call reads another matrix
    # of a pool of about twice the last-level cache (at most 1 GiB)
    hot = microbench.time_matmul("Q4_K", 4096, 4096, [1], threads=1, cold=False, repack=False)
    cold = microbench.time_matmul("Q4_K", 4096, 4096, [1], threads=1, cold=True, repack=False)
    assert hot.pool == 1 and cold.pool >= 2
    matrix = 9 << 20  # 4096 rows of 144 blocks of 144 bytes, 9 MiB
    want = min(2 * microbench.last_level_cache_bytes(), microbench.POOL_CAP_BYTES)
    assert want - matrix <= cold.pool_bytes <= microbench.POOL_CAP_BYTES
    assert cold[1] > 0.7 * hot[1], (hot, cold)


def test_graph_node_cost_is_small_and_positive() -> None:
    t = microbench.time_graph_node(threads=1)
    assert 0 < t < 1e-3, t
    costs = microbench.time_graph_costs(threads=1, n_nodes=64, runs=5)
    assert 0 < costs.node_s < costs.one_node_s < 1e-2, costs


def test_host_copy_bandwidth() -> None:
    bw = microbench.host_copy_bandwidth(32 << 20)
    assert math.isfinite(bw) and bw > 1e8, bw  # at least 100 MB/s


def test_h2d_on_the_cpu_device() -> None:
    cpu = ggml_graph.cpu_device()
    bw = microbench.h2d_bandwidth(cpu, pinned=False, nbytes=8 << 20)
    assert bw is not None and math.isfinite(bw) and bw > 1e8, bw
    pinned = microbench.h2d_bandwidth(cpu, pinned=True, nbytes=8 << 20)
    assert pinned is None or pinned > 0  # the CPU has no host buffer type of its own


def test_repeated_calls_free_what_they_allocate() -> None:
    for _ in range(3):  # allocator warm-up
        microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 64], threads=1, cold=False, min_seconds=0.001)
    before = _rss_bytes()
    for _ in range(30):  # each holds ~2.5 MB of weights and ~0.5 MB of activations
        microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 64], threads=1, cold=False, min_seconds=0.001)
        microbench.time_matmul("Q8_0", 1024, 512, [1, 64], threads=1, cold=False, min_seconds=0.001)
    assert _rss_bytes() - before < 32 << 20


RPC_SCRIPT = textwrap.dedent("""
    import json, math, sys
    from edgemoe.perf.measure import microbench
    from edgemoe.runtime import native

    dev = native.rpc_loopback_device()
    ffn = microbench.time_expert_ffn("Q4_K", 1024, 512, [1, 64], threads=1, cold=False, device=dev,
                                  min_seconds=0.01)
    mm = microbench.time_matmul("Q8_0", 512, 256, [1, 8], threads=1, cold=True, device=dev, min_seconds=0.01,
                             pool_bytes=8 << 20)
    out = {
        "device": native.device_name(dev),
        "ffn": {str(k): v for k, v in ffn.items()}, "ffn_buft": ffn.buffer_type, "ffn_backend": ffn.backend,
        "mm": {str(k): v for k, v in mm.items()}, "mm_pool": mm.pool, "mm_buft": mm.buffer_type,
        "node": microbench.time_graph_node(device=dev, threads=1, n_nodes=16, runs=3),
        "h2d": microbench.h2d_bandwidth(dev, pinned=False, nbytes=4 << 20),
        "h2d_pinned": microbench.h2d_bandwidth(dev, pinned=True, nbytes=4 << 20),
        "h2d_loads": microbench.h2d_load_bandwidth(dev, nbytes=8 << 20),
    }
    json.dump(out, open(sys.argv[1], "w"))
""")


def test_rpc_loopback_device(tmp_path: Path) -> None:
    """The device path: a backend of its own (llama.cpp's RPC server on loopback stands in for a GPU)."""
    result = tmp_path / "rpc.json"
    proc = subprocess.run([sys.executable, "-c", RPC_SCRIPT, str(result)], check=False, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["device"].startswith("RPC"), out
    assert out["ffn_buft"].startswith("RPC") and out["ffn_backend"].startswith("RPC"), out
    assert out["mm_buft"].startswith("RPC") and out["mm_pool"] >= 2, out
    assert all(_ok(v) for v in (*out["ffn"].values(), *out["mm"].values(), out["node"])), out
    assert out["ffn"]["64"] > out["ffn"]["1"], out
    assert out["h2d"] is not None and out["h2d"] > 0, out
    assert out["h2d_pinned"] is None or out["h2d_pinned"] > 0, out
    assert out["h2d_loads"] > 0, out  # the loader's path: async chunks over the RPC connection


def test_load_bandwidth_on_the_cpu_device() -> None:
    """The loader path's measure (chunked async copies on a backend of the device, one synchronisation)."""
    bw = microbench.h2d_load_bandwidth(ggml_graph.cpu_device(), chunk=1 << 20, nbytes=8 << 20)
    assert math.isfinite(bw) and bw > 1e8, bw
    with pytest.raises(EdgeMoeError, match="at least one chunk"):
        microbench.h2d_load_bandwidth(ggml_graph.cpu_device(), chunk=4 << 20, nbytes=1 << 20)
