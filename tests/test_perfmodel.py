"""The performance model's pure parts: profiles, the cost model, workloads and the simulator's replay."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.trace import DECODE, PREFILL
from edgemoe.cli.main import cli
from edgemoe.errors import EdgeMoeError
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.model.costmodel import LayerCosts, ModelShape
from edgemoe.perf.model.profile import (
    TOKEN_GRID,
    Curve,
    HostProfile,
    ProfileError,
    RatePoint,
    Roofline,
    bundled_profiles,
    load_profile,
    profile_from_dict,
)
from edgemoe.perf.model.simulate import ConfigResult, SimSpec, simulate
from edgemoe.perf.model.workload import GatingSpec, build_workload
from edgemoe.policies.gating import GatingRule
from edgemoe.policies.residency import LruPolicy
from edgemoe.policies.residency import replay_policy as replay_residency

from helpers.models import MIXTRAL, QWEN
from helpers.traces import skewed_trace

# --------------------------------------------------------------------------- profiles


def test_curve_interpolates_between_points_and_scales_past_the_last() -> None:
    c = Curve((RatePoint(1, 1e-6, 1e-10, 5e-11), RatePoint(4, 2e-6, 2e-10, 1e-10)))
    assert c.rate(1) == c.points[0] and c.rate(4).s_per_byte == pytest.approx(2e-10)
    mid = c.rate(2)
    assert 1e-10 < mid.s_per_byte < 2e-10 and 1e-6 < mid.fixed_s < 2e-6
    assert c.rate(16).s_per_byte == pytest.approx(8e-10)  # compute-bound: four times the tokens
    assert c.seconds(1e6, 1) == pytest.approx(1e-6 + 1e-4)
    assert c.seconds(1e6, 1, hot=True) == pytest.approx(1e-6 + 5e-5)


def test_roofline_is_memory_bound_for_one_token_and_compute_bound_for_many() -> None:
    r = Roofline(mem_bw=100e9, flops=1e12)
    c = r.curve("Q4_K")
    assert c.rate(1).s_per_byte == pytest.approx(1 / 100e9)
    wpb = 256 / 144
    assert c.rate(512).s_per_byte == pytest.approx(2 * 512 * wpb / 1e12)
    assert [p.tokens for p in c.points] == list(TOKEN_GRID)


def test_bundled_profiles_load_and_name_their_sources() -> None:
    names = bundled_profiles()
    assert {"rtx4060-laptop", "rtx4090-desktop", "h100-server"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.kind == "spec" and p.has_gpu and len(p.sources) >= 2
        assert p.gpu is not None and p.gpu.roofline.mem_bw > p.cpu.roofline.mem_bw
        assert p.link is not None and p.link.h2d_pinned >= p.link.h2d_pageable


def test_profile_round_trips_and_bad_files_say_what_to_do(tmp_path: Path) -> None:
    p = load_profile("rtx4060-laptop")
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    with pytest.raises(ProfileError, match="bundled"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "bad.json")
    d = p.to_dict()
    del d["cpu"]["roofline"]
    with pytest.raises(ProfileError, match="edgemoe profile"):
        profile_from_dict(d)
    d = p.to_dict()
    d["format"] = 99
    with pytest.raises(ProfileError, match="format"):
        profile_from_dict(d)


# --------------------------------------------------------------------------- the cost model


def test_model_shape_reads_expert_slices_dense_matrices_and_head() -> None:
    shape = ModelShape.read(QWEN)
    info = read_model_info(QWEN)
    assert shape.moe_layers == info.moe_layers
    for il in info.moe_layers:
        assert shape.expert_bytes(il) == info.bytes_per_expert_by_layer[il]
        assert len(shape.layer(il).dense) >= 4  # q, k, v, o projections and the router
    assert shape.head.nbytes > 0 and shape.n_vocab == info.n_vocab


def test_layer_costs_grow_with_tokens_and_context() -> None:
    prof = load_profile("rtx4060-laptop")
    costs = LayerCosts.of(prof.cpu, ModelShape.read(QWEN))
    assert costs.hot  # 10 MB of weights fit a 24 MiB cache
    assert costs.expert(0, 64) > costs.expert(0, 1) > 0
    assert costs.attention(0, 1, 400) > costs.attention(0, 1, 10)
    assert costs.decode_step(100) > costs.decode_step(100, experts_per_layer=1)


# --------------------------------------------------------------------------- workloads


def test_workload_splits_prefill_into_ubatches_and_counts_the_cache() -> None:
    tr = skewed_trace(QWEN, n_seq=2, prefill=40, decode=5)
    info = read_model_info(QWEN)
    w = build_workload(tr, info.moe_layers, info.n_expert, info.n_expert_used, n_ubatch=16)
    pre = [s for s in w.steps if s.phase == PREFILL]
    assert [s.n_tokens for s in pre] == [16, 16, 8] * 2 and [s.kv_len for s in pre[:3]] == [0, 16, 32]
    dec = [s for s in w.steps if s.phase == DECODE]
    assert [s.kv_len for s in dec[:5]] == [40, 41, 42, 43, 44] and all(s.n_tokens == 1 for s in dec)
    assert w.tokens(PREFILL) == 80 and w.tokens(DECODE) == 10


def test_workload_gating_drops_decode_slots_only_and_never_the_first() -> None:
    tr = skewed_trace(QWEN)
    info = read_model_info(QWEN)
    g = build_workload(tr, info.moe_layers, info.n_expert, 4, gating=GatingSpec(GatingRule.SER, 0.9))
    dropped = sum(int((s.ids < 0).sum()) for s in g.steps if s.phase == DECODE)
    assert dropped > 0
    assert all((s.ids >= 0).all() for s in g.steps if s.phase == PREFILL)
    assert all((s.ids[:, :, 0] >= 0).all() for s in g.steps)


def test_workload_refuses_another_routing_shape_and_cycles_layers() -> None:
    info = read_model_info(QWEN)
    with pytest.raises(EdgeMoeError, match="top-2 of 8"):
        build_workload(skewed_trace(MIXTRAL), info.moe_layers, info.n_expert, info.n_expert_used)
    w = build_workload(skewed_trace(QWEN, layers=3), info.moe_layers, info.n_expert, info.n_expert_used)
    assert "mod 3" in w.note
    assert np.array_equal(w.steps[0].ids[:, 3, :], w.steps[0].ids[:, 0, :])


# --------------------------------------------------------------------------- the simulator


def _by_name(res):  # type: ignore[no-untyped-def]
    return {c.name: c for c in res.configs}


def test_simulated_lru_hit_rate_equals_the_residency_replay() -> None:
    tr = skewed_trace(QWEN)
    info = read_model_info(QWEN)
    prof = load_profile("rtx4060-laptop")
    res = simulate(QWEN, tr, prof, SimSpec(vram=518 * 2**20, n_ctx=512, policies=("lru",)))
    slots = res.slots_per_layer
    assert 0 < slots < info.n_expert
    w = build_workload(tr, info.moe_layers, info.n_expert, info.n_expert_used)
    steps = [[(il, s.ids[:, j, :]) for j, il in enumerate(info.moe_layers)] for s in w.steps]
    want = replay_residency(LruPolicy({il: slots for il in info.moe_layers}), steps)
    assert _by_name(res)["edgemoe-lru"].hit_rate == pytest.approx(want.hit_rate)


def test_simulated_daop_hit_rate_equals_the_residency_replay(tmp_path: Path) -> None:
    """daop in the performance model: placed by the decode counts of the trace's first half (or of the
    calibration), replayed over the rest with its prompt swaps, as DaopPolicy replays on the same steps."""
    from edgemoe.perf.model.simulate import static_frequency
    from edgemoe.perf.model.workload import Workload
    from edgemoe.policies.daop import DaopPolicy

    tr = skewed_trace(QWEN)
    info = read_model_info(QWEN)
    prof = load_profile("rtx4060-laptop")
    res = simulate(QWEN, tr, prof, SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static", "daop")))
    slots = res.slots_per_layer
    full = build_workload(tr, info.moe_layers, info.n_expert, info.n_expert_used)
    placed = tuple(s for s in full.steps if s.seq < 2 and s.phase == DECODE)
    freq = static_frequency(Workload(placed, full.moe_layers, full.n_expert))
    rest = [s for s in full.steps if s.seq >= 2]
    steps = [[(il, s.ids[:, j, :]) for j, il in enumerate(info.moe_layers)] for s in rest]
    want = replay_residency(DaopPolicy(freq, {il: slots for il in info.moe_layers}, info.n_expert), steps)
    got = _by_name(res)["edgemoe-daop"]
    assert got.hit_rate == pytest.approx(want.hit_rate) and 0 < want.hit_rate < 1
    assert "daop" in res.workload_note


def test_simulation_configurations_follow_the_budget() -> None:
    tr = skewed_trace(QWEN)
    prof = load_profile("rtx4060-laptop")
    small = simulate(QWEN, tr, prof, SimSpec(vram=517 * 2**20, n_ctx=512))
    big = simulate(QWEN, tr, prof, SimSpec(vram=2**30, n_ctx=512))
    assert big.slots_per_layer == 32 and big.n_cpu_moe == 0
    assert _by_name(big)["edgemoe-static"].hit_rate == 1.0
    assert small.slots_per_layer < big.slots_per_layer
    s, b = _by_name(small), _by_name(big)
    assert b["edgemoe-lru"].hit_rate > s["edgemoe-lru"].hit_rate
    assert b["edgemoe-static"].decode_tps > s["edgemoe-static"].decode_tps
    assert all(c.name.startswith("stock-") for c in small.configs if c.kind == "stock")
    assert {"stock-ot-exps-cpu", "edgemoe-lru", "edgemoe-static"} <= set(s)


def test_overlap_and_cpu_only_projections() -> None:
    tr = skewed_trace(QWEN)
    prof = load_profile("rtx4060-laptop")
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("lru",))
    serial = _by_name(simulate(QWEN, tr, prof, spec))["edgemoe-lru"]
    overlap = _by_name(simulate(QWEN, tr, prof, dataclasses.replace(spec, overlap=True)))["edgemoe-lru"]
    assert overlap.decode_tps >= serial.decode_tps
    # the overlap is edgemoe's: stock llama.cpp's rows run a layer's two branches in turn either way
    stock = {o: _by_name(simulate(QWEN, tr, prof, dataclasses.replace(spec, overlap=o)))["stock-ot-exps-cpu"]
             for o in (False, True)}
    assert stock[True].decode_tps == stock[False].decode_tps and stock[True].prefill_tps == stock[False].prefill_tps
    # without host and node costs a gate that drops experts can only make a CPU step faster
    free = dataclasses.replace(prof, host=HostProfile(0.0, 0.0),
                               cpu=dataclasses.replace(prof.cpu, node_s=0.0))
    cpu = _by_name(simulate(QWEN, tr, free, SimSpec(vram=0, gated=True),
                            gating=GatingSpec(GatingRule.SER, 0.9)))
    assert set(cpu) == {"stock-cpu", "edgemoe-cpu", "edgemoe-cpu-gated"}
    assert cpu["stock-cpu"].decode_tps == cpu["edgemoe-cpu"].decode_tps
    assert cpu["edgemoe-cpu-gated"].decode_tps > cpu["edgemoe-cpu"].decode_tps
    assert cpu["stock-cpu"].hit_rate is None and cpu["stock-cpu"].pcie_bytes_per_token == 0


def test_simulate_cli_json_has_the_documented_fields(tmp_path: Path) -> None:
    tr = skewed_trace(QWEN).save(tmp_path / "t.npz")
    r = CliRunner().invoke(cli, ["simulate", str(QWEN), "--trace", str(tr), "--profile", "rtx4090-desktop",
                                 "--vram", "518MiB", "--ctx", "512", "--gating", "ser", "--threshold", "0.5",
                                 "--json", "--plot", str(tmp_path / "p.png")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    for c in d["configs"]:
        assert {"name", "decode_tps", "prefill_tps", "ttft_s", "hit_rate", "pcie_bytes_per_token",
                "bottleneck"} <= set(c)
        assert c["decode_tps"] > 0 and c["prefill_tps"] > 0
    assert any(c["name"] == "edgemoe-lru-gated" for c in d["configs"])
    assert (tmp_path / "p.png").stat().st_size > 0
    text = CliRunner().invoke(cli, ["simulate", str(QWEN), "--trace", str(tr), "--profile", "rtx4060-laptop",
                                    "--vram", "0"], catch_exceptions=False).output
    assert "PROJECTED" in text and "stock-cpu" in text
    bad = CliRunner().invoke(cli, ["simulate", str(QWEN), "--trace", str(tr), "--profile", "nope"])
    assert bad.exit_code != 0 and "bundled" in bad.output
    half = CliRunner().invoke(cli, ["simulate", str(QWEN), "--trace", str(tr), "--profile", "rtx4060-laptop",
                                    "--gating", "ser"])
    assert half.exit_code != 0 and "--threshold" in half.output


# --------------------------------------------------------------------------- profiling


def test_curve_fit_splits_fixed_and_per_byte_time() -> None:
    from edgemoe.perf.measure.profile_curves import _fit

    small = {c: 2e-6 + 1e-10 * c * 1000 for c in (1, 8)}
    large = {c: 2e-6 + 1e-10 * c * 9000 for c in (1, 8)}
    fit = _fit(small, large, 1000, 9000)
    assert [c for c, _, _ in fit] == [1, 8]
    for c, fixed, per_byte in fit:
        assert fixed == pytest.approx(2e-6) and per_byte == pytest.approx(1e-10 * c)
    # a one-node graph's call and dispatch come off the fixed part only, which stays at least 0
    less = _fit(small, large, 1000, 9000, overhead_s=1.5e-6)
    assert [f for _, f, _ in less] == pytest.approx([5e-7, 5e-7])
    assert [s for _, _, s in less] == [s for _, _, s in fit]
    assert all(f == 0.0 for _, f, _ in _fit(small, large, 1000, 9000, overhead_s=1e-5))


@pytest.mark.slow
def test_profile_command_measures_this_machine(tmp_path: Path) -> None:
    out = tmp_path / "me.json"
    r = CliRunner().invoke(cli, ["profile", "--out", str(out), "-t", "1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.kind == "measured" and prof.cpu.threads == 1
    assert {"Q4_K", "Q8_0"} <= set(prof.cpu.expert) and {"F16", "F32"} <= set(prof.cpu.matmul)
    q4 = prof.cpu.expert["Q4_K"]
    assert q4.seconds(2_654_208, 512) > 10 * q4.seconds(2_654_208, 1)
    assert prof.host.call_s >= 0 and prof.host.vocab_s >= 0 and prof.cpu.node_s > 0
    assert prof.cpu.roofline.mem_bw > 1e9


def test_prefill_assignment_variant_is_close_to_offloading_every_miss_or_better() -> None:
    """Without launch and host costs (the assigner does not see them) the assignment can only lose by one
    expert's time per layer against copying every miss (one of the placements it considers)."""
    tr = skewed_trace(QWEN, prefill=128, decode=10)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None
    prof = dataclasses.replace(prof, host=HostProfile(0.0, 0.0), gpu=dataclasses.replace(prof.gpu, node_s=0.0))
    res = _by_name(simulate(QWEN, tr, prof, SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static",),
                                                    assign="ratio")))
    base, assigned = res["edgemoe-static"], res["edgemoe-static-ratio-assign"]
    assert assigned.prefill_tps >= 0.95 * base.prefill_tps
    assert assigned.decode_tps == pytest.approx(base.decode_tps)  # decode steps are not assigned


def test_a_device_without_op_offload_keeps_prefill_experts_on_the_cpu() -> None:
    """llama.cpp offloads a large batch's ops on host weights to a CUDA device (copying the experts) but
    not to the RPC backend (no offload_op): a profile says which, and prefill's PCIe bytes and CPU share
    follow it while decode is unchanged."""
    tr = skewed_trace(QWEN, prefill=128, decode=10)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None and prof.gpu.op_offload
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=())
    cuda = _by_name(simulate(QWEN, tr, prof, spec))["stock-ot-exps-cpu"]
    rpc_like = dataclasses.replace(prof, gpu=dataclasses.replace(prof.gpu, op_offload=False))
    rpc = _by_name(simulate(QWEN, tr, rpc_like, spec))["stock-ot-exps-cpu"]
    assert cuda.prefill_tps != pytest.approx(rpc.prefill_tps)
    assert rpc.decode_tps == pytest.approx(cuda.decode_tps)
    assert profile_from_dict(rpc_like.to_dict()).gpu.op_offload is False  # saved and read back


def test_cache_loads_cross_the_link_at_the_loaders_bandwidth() -> None:
    """The cache's loads go at `LinkProfile.loads_bw` (measured, else pinned: the loader's staging buffers), so a
    faster loader path projects lru faster with the same PCIe bytes; profiles without `h2d_loads` still load."""
    tr = skewed_trace(QWEN, prefill=64, decode=24)
    prof = load_profile("rtx4060-laptop")
    assert prof.link is not None and prof.link.h2d_loads is None and prof.link.loads_bw == prof.link.h2d_pinned
    slow_link = dataclasses.replace(prof.link, h2d_loads=prof.link.h2d_pinned / 50)
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("lru",))
    fast = _by_name(simulate(QWEN, tr, prof, spec))["edgemoe-lru"]
    slow = _by_name(simulate(QWEN, tr, dataclasses.replace(prof, link=slow_link), spec))["edgemoe-lru"]
    assert fast.decode_tps > slow.decode_tps and fast.pcie_bytes_per_token == slow.pcie_bytes_per_token > 0
    back = profile_from_dict(dataclasses.replace(prof, link=slow_link).to_dict())
    assert back.link is not None and back.link.loads_bw == pytest.approx(prof.link.h2d_pinned / 50)


def test_caller_issued_loads_end_the_step_that_queued_them() -> None:
    """On the RPC device the engine leaves the load worker off and the caller sends a step's loads when it
    synchronises after it: the copy time lands in that step (the prompt's loads in prefill), and no layer of
    the next step waits for them. With a worker (a CUDA device) they run on the link while the next step
    computes. The total time of the replay is the same or longer with the caller issuing."""
    tr = skewed_trace(QWEN, prefill=64, decode=24)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None
    slow = dataclasses.replace(prof.link, h2d_loads=prof.link.h2d_pinned / 50)  # loads that take a while
    cuda = dataclasses.replace(prof, link=slow)
    rpc = dataclasses.replace(cuda, gpu=dataclasses.replace(prof.gpu, name="RPC0[127.0.0.1:50052]"))
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("lru",))
    worker = _by_name(simulate(QWEN, tr, cuda, spec))["edgemoe-lru"]
    caller = _by_name(simulate(QWEN, tr, rpc, spec))["edgemoe-lru"]
    assert caller.prefill_tps < worker.prefill_tps  # the prompt's loads are sent before the first token
    assert caller.hit_rate == worker.hit_rate and caller.pcie_bytes_per_token == worker.pcie_bytes_per_token
    stock_cuda = _by_name(simulate(QWEN, tr, cuda, spec))["stock-ot-exps-cpu"]
    stock_rpc = _by_name(simulate(QWEN, tr, rpc, spec))["stock-ot-exps-cpu"]
    assert stock_rpc.decode_tps == pytest.approx(stock_cuda.decode_tps)  # no cache, no loads: the same


def test_a_warmup_sequence_is_replayed_but_not_counted() -> None:
    """`edgemoe bench` warms each configuration up before it measures; its projection replays the warm-up
    first (SimSpec.warmup_seqs): the cache starts warm, the counted tokens are the measured sequence's."""
    from edgemoe.analysis.trace import join_traces

    run = skewed_trace(QWEN, n_seq=1, prefill=40, decode=30, seed=1)
    warm = skewed_trace(QWEN, n_seq=1, prefill=16, decode=1, seed=2)
    joined = join_traces([warm, run])
    assert joined.n_tokens == warm.n_tokens + run.n_tokens and set(joined.seq.tolist()) == {0, 1}
    prof = load_profile("rtx4060-laptop")
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("lru",))
    cold = _by_name(simulate(QWEN, run, prof, spec))["edgemoe-lru"]
    warmed = _by_name(simulate(QWEN, joined, prof, dataclasses.replace(spec, warmup_seqs=1)))["edgemoe-lru"]
    counted = _by_name(simulate(QWEN, joined, prof, spec))["edgemoe-lru"]
    assert warmed.hit_rate > cold.hit_rate  # the warm-up's experts are resident when the run starts
    # the same replay, counted from the start: the warm-up's cold misses lower the hit rate
    assert counted.hit_rate < warmed.hit_rate
    # a warm-up that loads nothing (stock) changes nothing: the counted tokens are the run's own
    stock = _by_name(simulate(QWEN, run, prof, spec))["stock-ot-exps-cpu"]
    stock_warmed = _by_name(simulate(QWEN, joined, prof, dataclasses.replace(spec, warmup_seqs=1)))["stock-ot-exps-cpu"]
    assert stock_warmed.decode_tps == pytest.approx(stock.decode_tps)
    assert stock_warmed.prefill_tps == pytest.approx(stock.prefill_tps)
    with pytest.raises(EdgeMoeError, match="different MoE layers"):
        join_traces([run, skewed_trace(QWEN, n_seq=1, layers=2)])


def test_overlapped_cpu_experts_wait_for_the_layers_dense_part() -> None:
    """With the overlap, a layer's CPU experts start only after its attention and router: a CPU-bound layer
    (every expert on the CPU, none cached) takes dense + CPU experts, as without the overlap, so a cache with
    no slots gains nothing from it."""
    tr = skewed_trace(QWEN, prefill=32, decode=16)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None  # no launch bound: the GPU side is the layer's own work
    prof = dataclasses.replace(prof, host=HostProfile(0.0, 0.0), gpu=dataclasses.replace(prof.gpu, node_s=0.0))
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static",), slots={il: 0 for il in
                                                                             read_model_info(QWEN).moe_layers})
    serial = _by_name(simulate(QWEN, tr, prof, spec))["edgemoe-static"]
    overlap = _by_name(simulate(QWEN, tr, prof, dataclasses.replace(spec, overlap=True)))["edgemoe-static"]
    assert overlap.decode_tps == pytest.approx(serial.decode_tps)
    assert overlap.prefill_tps == pytest.approx(serial.prefill_tps)


def test_device_prefill_copies_one_layer_ahead_of_its_experts() -> None:
    """--device-prefill projected: a prefill ubatch runs every routed expert on the GPU after a copy of
    the layer's experts outside the slots, issued at the previous cached layer's routing. With a free link the layer
    is its GPU experts only (faster than the CPU's misses); with a link 1000x slower the copies dominate; decode
    steps (one token) run as without it; the variant's slots leave room for the two buffers."""
    tr = skewed_trace(QWEN, prefill=128, decode=10)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None and prof.link is not None
    prof = dataclasses.replace(prof, gpu=dataclasses.replace(prof.gpu, op_offload=False))  # misses on the CPU
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static",), overlap=True, device_prefill=True)
    res = simulate(QWEN, tr, prof, spec)
    by = _by_name(res)
    base, dp = by["edgemoe-static"], by["edgemoe-static-device-prefill"]
    assert dp.prefill_tps > base.prefill_tps
    assert dp.decode_tps == pytest.approx(base.decode_tps, rel=0.05)  # same steps, maybe fewer slots
    slow = dataclasses.replace(prof, link=dataclasses.replace(prof.link, h2d_loads=prof.link.loads_bw / 1000))
    dp_slow = _by_name(simulate(QWEN, tr, slow, spec))["edgemoe-static-device-prefill"]
    assert dp_slow.prefill_tps < dp.prefill_tps / 5
    info = read_model_info(QWEN)
    from edgemoe.plan.budget import prefill_buffer_bytes, slot_budget
    from edgemoe.plan.reserve import VRAM_RESERVE, Reserve, reserve_bytes

    buffers = reserve_bytes(info, 512, Reserve(device_prefill=True))
    assert buffers == VRAM_RESERVE + prefill_buffer_bytes(info) > reserve_bytes(info, 512) == VRAM_RESERVE
    with_buf = slot_budget(info, spec.vram, n_ctx=512, reserve_bytes=buffers)
    assert with_buf.experts_per_layer <= res.slots_per_layer


def test_precalc_hides_cpu_experts_under_the_target_layers_attention_only_with_the_overlap(tmp_path: Path) -> None:
    """DAOP's pre-calculation projected: with the GPU's attention slow (2 ms a layer), the CPU's experts
    shorter than it, and no host or launch costs, a perfect prediction moves a decode step's CPU experts of every target layer under that
    attention, so decode is faster with the overlap; without it the early split runs in turn and adds its
    hand-off and fixed cost; wasted predictions (precision < 1) or none used (recall 0) cost CPU time. Prefill
    steps and the cache's residency are untouched."""
    from edgemoe.perf.model.profile import Curve, RatePoint
    from edgemoe.perf.model.simulate import PrecalcSpec

    tr = skewed_trace(QWEN, prefill=32, decode=32)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None
    slow_attention = Curve((RatePoint(1, 1e-3, 0.0, 0.0),))
    roof = prof.cpu.roofline  # the fixture's experts as slow as big ones (0.45 ms), still shorter than the attention
    slow_cpu = dataclasses.replace(roof, mem_bw=roof.mem_bw / 1000, cache_bw=roof.cache_bw / 1000)
    prof = dataclasses.replace(prof, host=HostProfile(0.0, 0.0),
                               cpu=dataclasses.replace(prof.cpu, node_s=0.0, roofline=slow_cpu),
                               gpu=dataclasses.replace(prof.gpu, node_s=0.0, attention=slow_attention))
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static",))

    def run(pc: PrecalcSpec, overlap: bool = True) -> tuple[ConfigResult, ConfigResult]:
        by = _by_name(simulate(QWEN, tr, prof, dataclasses.replace(spec, overlap=overlap, precalc=pc)))
        return by["edgemoe-static"], by["edgemoe-static-precalc"]

    base, perfect = run(PrecalcSpec(1, 1.0, 1.0))
    assert perfect.decode_tps > 1.05 * base.decode_tps
    assert perfect.prefill_tps == pytest.approx(base.prefill_tps)
    assert perfect.hit_rate == base.hit_rate and perfect.pcie_bytes_per_token == base.pcie_bytes_per_token
    wasteful = run(PrecalcSpec(1, 1.0, 0.3))[1]
    assert wasteful.decode_tps < perfect.decode_tps
    assert run(PrecalcSpec(1, 0.0, 1.0))[1].decode_tps <= base.decode_tps
    serial_base, serial = run(PrecalcSpec(1, 1.0, 1.0), overlap=False)
    assert serial.decode_tps < serial_base.decode_tps
    # only the later layers: less of the gain
    late = run(PrecalcSpec(6, 1.0, 1.0))[1]
    assert base.decode_tps < late.decode_tps < perfect.decode_tps
    # a layer without slots has no cache and no tables: nothing is pre-calculated there
    moe = read_model_info(QWEN).moe_layers
    none = _by_name(simulate(QWEN, tr, prof, dataclasses.replace(
        spec, overlap=True, slots={il: 0 for il in moe}, precalc=PrecalcSpec(1, 1.0, 1.0))))
    assert none["edgemoe-static-precalc"].decode_tps == pytest.approx(none["edgemoe-static"].decode_tps)
    with pytest.raises(ValueError, match="layer before"):
        PrecalcSpec(0, 0.5, 0.5)
    with pytest.raises(ValueError, match="precision"):
        PrecalcSpec(1, 0.5, 0.0)
    with pytest.raises(EdgeMoeError, match="nothing to pre-calculate"):
        simulate(QWEN, tr, prof, dataclasses.replace(spec, precalc=PrecalcSpec(len(moe), 1.0, 1.0)))
    # the command line: a variant per policy, and the refusal with the routing hook's blocking loads
    path = tr.save(tmp_path / "t.npz")
    args = ["simulate", str(QWEN), "--trace", str(path), "--profile", "rtx4060-laptop", "--vram", "518MiB",
            "--ctx", "512", "--policy", "daop", "--precalc-from", "5", "--json"]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert {"edgemoe-daop", "edgemoe-daop-precalc"} <= {c["name"] for c in json.loads(r.output)["configs"]}
    bad = CliRunner().invoke(cli, args + ["--blocking-loads"])
    assert bad.exit_code != 0 and "--blocking-loads" in bad.output


def test_decode_split_projection_shares_a_miss_between_cpu_and_gpu_when_the_link_is_fast() -> None:
    """The FreeToken-style decode split (projected only; no row-split path exists in the runtime): a step's CPU
    experts are cut by rows so that the CPU's share and the GPU's copy-then-compute of the rest end together
    (split_share), or, where one side alone is faster, the CPU or the GPU after a whole copy. With a fast link a
    CPU-bound decode gets faster and the link carries the GPU's share; with a link 10^5 times slower the split hands
    the GPU almost nothing; prefill ubatches (op offload) are untouched."""
    from edgemoe.policies.assignment import split_share

    f = split_share(3.0, 5.0, 1.0)
    assert 1.0 + f * 3.0 == pytest.approx((1.0 - f) * 5.0)
    assert split_share(1.0, 0.5, 1.0) < 0  # the hand-off alone outlasts the GPU: no split
    tr = skewed_trace(QWEN, prefill=40, decode=32)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None and prof.link is not None
    roof = prof.cpu.roofline  # a slow CPU: decode is bound by the CPU's misses
    prof = dataclasses.replace(prof, host=HostProfile(0.0, 0.0),
                               cpu=dataclasses.replace(prof.cpu, node_s=0.0, roofline=dataclasses.replace(
                                   roof, mem_bw=roof.mem_bw / 1000, cache_bw=roof.cache_bw / 1000)),
                               gpu=dataclasses.replace(prof.gpu, node_s=0.0),
                               link=dataclasses.replace(prof.link, latency_s=0.0))
    spec = SimSpec(vram=518 * 2**20, n_ctx=512, policies=("static",), overlap=True, decode_split=True)
    by = _by_name(simulate(QWEN, tr, prof, spec))
    base, split = by["edgemoe-static"], by["edgemoe-static-decode-split"]
    assert split.decode_tps > 1.3 * base.decode_tps
    assert split.pcie_bytes_per_token > base.pcie_bytes_per_token
    assert split.prefill_tps == pytest.approx(base.prefill_tps) and split.hit_rate == base.hit_rate
    slow = dataclasses.replace(prof, link=dataclasses.replace(prof.link, h2d_loads=prof.link.loads_bw / 1e5))
    by = _by_name(simulate(QWEN, tr, slow, spec))
    assert by["edgemoe-static-decode-split"].decode_tps == pytest.approx(by["edgemoe-static"].decode_tps, rel=0.02)
