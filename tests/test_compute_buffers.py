"""llama.cpp's compute buffers measured by a no_alloc load (edgemoe.perf.measure.compute_buffers) against the
planner's estimate (edgemoe.plan.reserve.compute_buffer_bytes), on the CPU and on the RPC device, and the plan's
reserve from a measurement where it has one."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.measure.compute_buffers import MeasuredCompute, measure_grid
from edgemoe.plan import Device, cache_request, plan
from edgemoe.plan.reserve import (
    PLAN_UBATCH,
    RESERVE_CTX,
    VRAM_RESERVE,
    Reserve,
    compute_buffer_bytes,
    reserve_bytes,
)
from edgemoe.runtime.config import LoadConfig

from helpers.models import FIXTURE_MODELS
from helpers.rpc_child import run_child

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
# the estimate's stated error (docs/research/performance-model.md, "Compute buffers, measured"): at most 3 KiB per
# token of the ubatch or 1.5% over the buffer (the F16 mask's rows, which the RPC device leaves on the host), and at
# most 0.5% under it


def _within(estimate: int, measured: int, n_ubatch: int) -> bool:
    over = estimate - measured
    return -0.005 * measured <= over <= max(3072 * n_ubatch, 0.015 * measured)


@pytest.mark.parametrize("fa", ["on", "off"])
def test_the_estimate_is_within_its_stated_error_on_the_cpu(fa: str) -> None:
    info = read_model_info(QWEN)
    rows = measure_grid(QWEN, LoadConfig(flash_attn=fa), (4096, 16384), (512, 2048))  # type: ignore[arg-type]
    assert len(rows) == 4 and all(set(r.by_buffer) == {"CPU"} for r in rows)
    for r in rows:
        est = compute_buffer_bytes(info, r.n_ctx, r.n_ubatch, flash_attn=fa == "on")
        assert _within(est, r.total, r.n_ubatch), (r, est)
    # the buffer grows with the ubatch and with the context (the mask's rows; without flash attention the scores)
    by = {(r.n_ctx, r.n_ubatch): r.total for r in rows}
    assert by[(4096, 2048)] > by[(4096, 512)] and by[(16384, 512)] > by[(4096, 512)]


def test_the_estimate_is_within_its_stated_error_on_the_rpc_device(tmp_path: Path) -> None:
    """Every layer on the RPC device, the experts in CPU memory (a budget's load): the device's buffer is the one
    the budget pays for; open_engine measures it for its plan and the cache opens."""
    out = run_child("rpc_compute_check.py", QWEN, tmp_path, timeout=300)
    info = read_model_info(QWEN)
    assert out["device"] and len(out["rows"]) == 8
    assert set(out["slots"].values()) == {4}  # the budget for 4 slots, its reserve measured on the device
    for r in out["rows"]:
        assert any(name.startswith("RPC") for name in r["buffers"]), r
        est = compute_buffer_bytes(info, r["n_ctx"], r["n_ubatch"], flash_attn=r["fa"] == "on")
        assert _within(est, r["device"], r["n_ubatch"]), (r, est)


def test_a_plan_with_a_measured_device_reserves_the_measurement() -> None:
    """Where the device's buffers were measured, the reserve is VRAM_RESERVE plus their growth past RESERVE_CTX
    and PLAN_UBATCH, measured; the estimate's terms are not used."""
    info = read_model_info(QWEN)
    measured = MeasuredCompute(QWEN, LoadConfig(), device_only=False)  # no device here: the CPU's buffer
    grown = measured(16384, 1024, True) - measured(RESERVE_CTX, PLAN_UBATCH, True)
    assert grown > 0
    what = Reserve(n_ubatch=1024, measured=measured)
    assert reserve_bytes(info, 16384, what) == VRAM_RESERVE + grown
    assert reserve_bytes(info, 4096, Reserve(measured=measured)) == VRAM_RESERVE
    header = check_gguf(QWEN)
    req = cache_request(vram=2**30, policy="lru")
    device = Device("RPC0", compute=measured)
    p = plan(header, req, n_ctx=16384, device=device, n_ubatch=1024)
    assert p.reserve_bytes == VRAM_RESERVE + grown
    assert p.budget is not None and p.budget.reserve_bytes == p.reserve_bytes
