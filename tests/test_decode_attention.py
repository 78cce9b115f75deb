"""The performance model's decode attention: a profile's measured layer attention with and without flash
attention (edgemoe.perf.model.profile.AttentionTimes), how the cost model prices a decode token by it, old
profiles without it, and the CPU probe that measures it (edgemoe.perf.measure.attention)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.trace import DECODE, PREFILL, Trace
from edgemoe.errors import EdgeMoeError
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.model.costmodel import KV_PAD, LayerCosts, ModelShape, graph_kv_length
from edgemoe.perf.model.profile import (
    AttentionTimes,
    MachineProfile,
    load_profile,
    nearest_attention,
    profile_from_dict,
)
from edgemoe.perf.model.simulate import SimSpec, simulate

QWEN = Path(__file__).resolve().parents[1] / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


def _times(n_head: int = 32, n_head_kv: int = 4, head_dim: int = 128) -> AttentionTimes:
    # flash attention: 100 us at 256 cached tokens and 0.5 us more per token; without it 150 us and 0.25 us
    kv = (256, 512, 1024, 4096)
    return AttentionTimes(n_head, n_head_kv, head_dim, kv, tuple(1e-4 + 5e-7 * (n - 256) for n in kv),
                          tuple(1.5e-4 + 2.5e-7 * (n - 256) for n in kv))


def _with_attention(prof: MachineProfile, *times: AttentionTimes) -> MachineProfile:
    return dataclasses.replace(prof, cpu=dataclasses.replace(prof.cpu, decode_attention=times))


def _decode_trace(n_prompt: int = 40, n_decode: int = 40) -> Trace:
    info = read_model_info(QWEN)
    n, layers, k = n_prompt + n_decode, len(info.moe_layers), info.n_expert_used
    ids = np.tile(np.arange(k, dtype=np.int32), (n, layers, 1))
    return Trace(tokens=np.zeros(n, np.int32), layers=np.arange(layers, dtype=np.int32), ids=ids,
                 weights=np.full((n, layers, k), 1.0 / k, np.float32),
                 phase=np.r_[np.full(n_prompt, PREFILL), np.full(n_decode, DECODE)].astype(np.uint8),
                 seq=np.zeros(n, np.int32), meta={"n_expert": info.n_expert, "model": "made-up"})


def test_attention_times_interpolate_extrapolate_and_scale_by_the_heads() -> None:
    a = _times()
    assert a.seconds(512, flash=True, heads=32, head_dim=128) == pytest.approx(1e-4 + 5e-7 * 256)
    assert a.seconds(768, flash=False, heads=32, head_dim=128) == pytest.approx(1.5e-4 + 2.5e-7 * 512)
    assert a.seconds(100, flash=True, heads=32, head_dim=128) == pytest.approx(1e-4)  # the first point's
    assert a.seconds(8192, flash=True, heads=32, head_dim=128) == pytest.approx(1e-4 + 5e-7 * (8192 - 256))
    assert a.seconds(512, flash=True, heads=16, head_dim=64) == pytest.approx((1e-4 + 5e-7 * 256) / 4)


def test_attention_times_refuse_inconsistent_records() -> None:
    with pytest.raises(ValueError, match="one flash and one plain"):
        AttentionTimes(32, 4, 128, (256, 512), (1e-4,), (1e-4, 2e-4))
    with pytest.raises(ValueError, match="ascending"):
        AttentionTimes(32, 4, 128, (512, 256), (1e-4, 2e-4), (1e-4, 2e-4))
    with pytest.raises(ValueError, match="positive"):
        AttentionTimes(32, 4, 128, (256, 512), (0.0, 2e-4), (1e-4, 2e-4))


def test_the_models_own_shape_is_preferred_else_the_nearest_work() -> None:
    big, small = _times(), _times(4, 2, 64)
    assert nearest_attention((big, small), 4, 2, 64) is small
    assert nearest_attention((big, small), 32, 4, 128) is big
    assert nearest_attention((big, small), 64, 8, 128) is big
    assert nearest_attention((big, small), 8, 8, 32) is small
    assert nearest_attention((), 32, 4, 128) is None


def test_a_shape_measured_with_its_caches_from_memory_prices_the_other_models() -> None:
    # the profile measures the model's shape over a pool of caches and the host fit's probes' tiny shape hot:
    # a model of neither shape is priced by the cold one, even where the hot one's work is nearer
    big, small = dataclasses.replace(_times(), pool_bytes=512 << 20), _times(4, 2, 64)
    assert nearest_attention((big, small), 8, 8, 32) is big
    assert nearest_attention((big, small), 4, 2, 64) is small  # its own shape still first
    assert nearest_attention((dataclasses.replace(big, pool_bytes=0), small), 8, 8, 32) is small


def test_graph_kv_length_pads_as_llama_cpp() -> None:
    assert [graph_kv_length(n) for n in (1, 256, 257, 600)] == [KV_PAD, 256, 512, 768]


def test_a_decode_token_is_priced_by_the_measured_attention_flash_or_not() -> None:
    shape = ModelShape.read(QWEN)
    info = shape.info
    prof = _with_attention(load_profile("rtx4060-laptop"), _times(info.n_head, info.n_head_kv, info.n_embd_head_k))
    flash = LayerCosts.of(prof.cpu, shape, flash_attn=True)
    plain = LayerCosts.of(prof.cpu, shape, flash_attn=False)
    # 300 cached tokens and the new one: a graph of 512
    assert flash.attention(0, 1, 300) == pytest.approx(1e-4 + 5e-7 * 256)
    assert plain.attention(0, 1, 300) == pytest.approx(1.5e-4 + 2.5e-7 * 256)
    # below 512 the CPU kernel skips the keys the mask hides: 160 cached and the new one of a graph of 256
    assert flash.attention(0, 1, 160) == pytest.approx(1e-4 * 161 / 256)
    assert plain.attention(0, 1, 160) == pytest.approx(1.5e-4)
    # steps of several tokens keep the F16 products' curve, flash attention or not
    curve = LayerCosts.of(load_profile("rtx4060-laptop").cpu, shape)
    assert flash.attention(0, 64, 300) == plain.attention(0, 64, 300) == curve.attention(0, 64, 300)
    assert flash.decode_step(300) - plain.decode_step(300) == pytest.approx(
        len(shape.layers) * (flash.attention(0, 1, 300) - plain.attention(0, 1, 300)))


def test_profiles_without_decode_attention_load_and_the_simulation_says_so(tmp_path: Path) -> None:
    prof = _with_attention(load_profile("rtx4060-laptop"), _times(), _times(4, 2, 64))
    assert load_profile(prof.save(tmp_path / "p.json")) == prof
    cold = _with_attention(prof, dataclasses.replace(_times(), pool_bytes=256 << 20))
    assert load_profile(cold.save(tmp_path / "cold.json")).cpu.decode_attention[0].pool_bytes == 256 << 20
    old = prof.to_dict()
    for times in old["cpu"]["decode_attention"]:
        del times["pool_bytes"]  # measured before the pools of caches: one cache, hot
    assert profile_from_dict(old) == prof
    del old["cpu"]["decode_attention"]  # a profile measured before 2026-11-27
    assert profile_from_dict(old).cpu.decode_attention == ()
    tr = _decode_trace()
    res = simulate(QWEN, tr, profile_from_dict(old), SimSpec(vram=0, n_ctx=512, policies=()))
    assert "no measured decode attention" not in res.workload_note  # a specification's: nothing was measured
    old["kind"] = "measured"
    res = simulate(QWEN, tr, profile_from_dict(old), SimSpec(vram=0, n_ctx=512, policies=()))
    assert "no measured decode attention" in res.workload_note
    res = simulate(QWEN, tr, prof, SimSpec(vram=0, n_ctx=512, policies=()))
    assert "decode attention" not in res.workload_note


def test_simulated_cpu_decode_follows_the_flash_attention_setting() -> None:
    info = read_model_info(QWEN)
    prof = _with_attention(load_profile("rtx4060-laptop"), _times(info.n_head, info.n_head_kv, info.n_embd_head_k))
    tr = _decode_trace()
    rows = {fa: next(c for c in simulate(QWEN, tr, prof, SimSpec(vram=0, n_ctx=512, policies=(), flash_attn=fa))
                     .configs if c.name == "stock-cpu") for fa in ("auto", "on", "off")}
    assert rows["auto"].decode_tps == rows["on"].decode_tps
    # the made-up flash attention is faster at a graph of 256 tokens: at most 100 against 150 us per layer
    assert rows["on"].decode_tps > rows["off"].decode_tps
    assert rows["on"].prefill_tps == rows["off"].prefill_tps  # prefill keeps the products' curve


def test_cpu_probe_times_both_paths_and_refuses_bad_shapes() -> None:
    from edgemoe.perf.measure.attention import AttentionShape, measure_decode_attention, time_attention

    shape = AttentionShape(4, 2, 64)
    (times,) = measure_decode_attention(threads=1, shapes=((shape, 0), (shape, 0)), rounds=3, min_seconds=0.0)
    assert (times.n_head, times.n_head_kv, times.head_dim, times.pool_bytes) == (4, 2, 64, 0)
    assert all(t > 0 for t in times.flash_s + times.plain_s)
    assert times.flash_s[-1] > times.flash_s[0] and times.plain_s[-1] > times.plain_s[0]
    # the one-node graph's overhead comes off every point, but never more than half of it
    (less,) = measure_decode_attention(threads=1, shapes=((shape, 0),), rounds=1, min_seconds=0.0, overhead_s=1.0)
    assert all(0 < t for t in less.flash_s + less.plain_s)
    with pytest.raises(EdgeMoeError, match="multiple of the KV heads"):
        time_attention(AttentionShape(4, 3, 64), (256,), threads=1, flash=True)
    with pytest.raises(EdgeMoeError, match="positive"):
        time_attention(shape, (), threads=1, flash=True)


def test_a_cold_pool_holds_enough_caches_and_is_timed_by_rotation() -> None:
    from edgemoe.perf.measure.attention import (
        MAX_POOL,
        AttentionShape,
        cache_bytes,
        pool_size,
        time_attention,
    )

    shape = AttentionShape(32, 4, 128)
    assert cache_bytes(shape, 256) == 2 * 2 * 4 * 128 * 256  # F16 K and V
    assert pool_size(shape, 256, 0) == 1
    assert pool_size(shape, 256, 64 << 20) == 128  # 64 MiB of 0.5 MiB caches
    assert pool_size(shape, 256, 1 << 40) == MAX_POOL
    assert pool_size(shape, 4096, 1) == 1
    small = AttentionShape(4, 2, 64)
    t = time_attention(small, (256,), threads=1, flash=True, min_seconds=0.0, pool_bytes=4 << 20)
    assert t[256] > 0


def test_the_layer_tool_measures_a_layer_and_prices_it_part_by_part(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    tool = Path(__file__).resolve().parents[1] / "tools" / "layer_cost_check.py"
    out = tmp_path / "layer.json"
    args = ["--preset", "tiny-qwen3moe", "--profile", "rtx4060-laptop", "--shallow", "1", "--deep", "3",
            "--prompt-tokens", "16", "--gen", "8", "--reps", "1", "--rounds", "1", "--threads", "1"]
    run = subprocess.run([sys.executable, str(tool), *args, "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["flash"]
    assert set(rows) == {"off", "on"}
    for row in rows.values():
        parts = [row[f"priced_{k}_ms"] for k in ("dense", "attention", "experts", "nodes")]
        assert all(p > 0 for p in parts) and row["priced_layer_ms"] == pytest.approx(sum(parts))
        assert set(row["decode_ms"]) == {"1", "3"} and row["measured_layer_ms"] != 0
        assert row["priced_over_measured"] == pytest.approx(row["priced_layer_ms"] / row["measured_layer_ms"])
    assert "a layer measured" in run.stdout
    bad = subprocess.run([sys.executable, str(tool), "--shallow", "3", "--deep", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--shallow" in bad.stderr
