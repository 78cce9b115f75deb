"""The promoe policy in the engine (the routing hook) with the cache on the CPU stand-in: greedy output equals
stock llama.cpp's (bitwise: both sides load with use_extra_bufts=False, as in test_expert_cache.py), with and
without adaptive top-k gating, and the live counters equal the timed replay (edgemoe.policies.replay) of the
same run's routes and router inputs.

The stand-in copies a chunk when it is issued; the controller issues, after each MoE layer, the chunks its
copy timing says the stream moves while the layer computes (all queued chunks without a timing), and llama.cpp
uses a load from its layer's next routing on: the replay's model of time, so the counts must agree exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.calibration.adaptive import default_calibration_dir
from edgemoe.cli import cli
from edgemoe.policies.copy_queue import CopyTiming
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.policies.promoe import PromoePolicy
from edgemoe.policies.replay import replay
from edgemoe.runtime.cache_config import CacheConfig, DaliConfig, PromoeConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.prefetcher import prefetch_predictor
from edgemoe.runtime.sampling import GREEDY

from helpers.models import FIXTURE_MODELS
from helpers.recorders import RouteRecorder

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)
LAYER_S = 1e-3


def _generate(path: Path, cache: CacheConfig | None, *, gating: GatingPolicy | None = None,
              recorder: RouteRecorder | None = None) -> tuple[list[int], object]:
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        c = eng.enable_expert_cache(cache) if cache is not None else None
        if gating is not None:
            eng.set_gating(gating)
        if recorder is not None:
            eng.set_policies([recorder])  # before the cache controller: the same (gated) ids
        toks = eng.generate(TEXT[:60], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        if c is None:
            return toks, None
        return toks, (c.stats(), eng.experts.report(), dict(c.n_slots), c.chunk_bytes, list(eng.info.moe_layers))


def _slow(path: Path) -> CopyTiming:
    """About one expert's bytes per MoE layer: speculative loads are often incomplete when their layer routes."""
    from edgemoe.gguf.info import read_model_info
    from edgemoe.runtime.expert_cache import expert_chunk_bytes

    chunks = expert_chunk_bytes(path, read_model_info(path).moe_layers)
    per_expert = float(np.mean([sum(c) for c in chunks.values()]))
    return CopyTiming(bandwidth=per_expert / LAYER_S, layer_s=LAYER_S)


@pytest.mark.parametrize("gated", [False, True], ids=["full-top-k", "gated"])
def test_promoe_generates_as_stock(fixture_model: Path, gated: bool) -> None:
    def gate() -> GatingPolicy | None:
        return GatingPolicy(GatingRule.SER, 0.5) if gated else None

    ref, _ = _generate(fixture_model, None, gating=gate())
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        n_expert = eng.info.n_expert
    cal = default_calibration_dir(fixture_model)
    for slots, timing, blocking in ((n_expert // 4, None, False), (n_expert // 2, _slow(fixture_model), False),
                                    (n_expert // 4, _slow(fixture_model), True)):
        got, out = _generate(fixture_model, CacheConfig(slots,
                                                        policy=PromoeConfig(calibration=cal, copy_timing=timing,
                                                                            blocking=blocking)), gating=gate())
        assert got == ref, (slots, timing, blocking)
        st, rep = out[0], out[1]  # type: ignore[index]
        assert st["hits"] > 0 and rep["prefetch"]["issued"] > 0 and rep["prefetch"]["predictor"] == "mlp-d2"


@pytest.mark.parametrize("slow,blocking,admission,native", [
    (False, False, True, True), (False, False, True, False), (False, True, True, True), (True, False, True, None),
    (True, False, False, None), (True, True, True, None)],
    ids=["instant-native", "instant-hook", "instant-blocking-native", "slow", "slow-no-admission", "slow-blocking"])
def test_live_counters_equal_the_replay(fixture_model: Path, slow: bool, blocking: bool, admission: bool,
                                        native: bool | None) -> None:
    """Native promoe (predicted prefetch: the in-graph predictor's ids, llama.cpp's decisions) and the hook's promoe both
    count what PromoePolicy replayed on the same routes and router inputs counts (the numpy predictor)."""
    cal = default_calibration_dir(fixture_model)
    timing = _slow(fixture_model) if slow else None
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        slots = eng.info.n_expert // 4
    rec = RouteRecorder()
    _, out = _generate(fixture_model, CacheConfig(slots, policy=PromoeConfig(calibration=cal,
                                                                             copy_timing=timing,
                                                                             blocking=blocking,
                                                                             admission=admission,
                                                                             native=native,
                                                                             weights="f32")), recorder=rec)
    st, rep, n_slots, chunks, layers = out  # type: ignore[misc]
    assert (rep["prefetch"].get("path") == "native") == (not slow and native is not False)
    pred, note = prefetch_predictor(fixture_model, cal, "mlp", 2)
    assert note is None
    policy = PromoePolicy(n_slots, layers, pred, blocking=blocking, timing=timing if admission else None)
    sim = replay(policy, rec.steps, timing=timing, chunk_bytes=chunks)
    assert (st["hits"], st["misses"]) == (sim.hits, sim.misses)
    pc = sim.prefetch
    assert pc is not None
    live = rep["prefetch"]
    assert (live["issued"], live["useful"], live["preempted"]) == (pc.issued, pc.useful, pc.preempted)
    assert live["goodpred"] == pytest.approx(pc.goodpred) and pc.issued > 0 and sim.misses > 0
    if slow and not admission:
        assert pc.preempted > 0 and pc.fetch_rate < 1.0  # ProMoE's rule on a slow link: early preemption had work
    if not slow:
        assert pc.preempted == 0 and pc.fetch_rate == 1.0
    if blocking and slow:
        assert sim.stall_s > 0.0


@pytest.mark.parametrize("gated", [False, True], ids=["full-top-k", "gated"])
def test_dali_with_its_prefetcher_generates_as_stock_and_as_replayed(fixture_model: Path, gated: bool) -> None:
    """dali with --dali-prefetch (edgemoe.policies.dali_prefetch) in the routing hook: stock tokens, the
    calibration's residual predictor one layer ahead, and the live counters of the replay on the same routes."""
    from edgemoe.policies.dali_prefetch import DaliPrefetchPolicy
    from edgemoe.policies.residency import dali_default_update

    def gate() -> GatingPolicy | None:
        return GatingPolicy(GatingRule.SER, 0.5) if gated else None

    ref, _ = _generate(fixture_model, None, gating=gate())
    cal = default_calibration_dir(fixture_model)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        n_expert = eng.info.n_expert
    rec = RouteRecorder()
    got, out = _generate(fixture_model, CacheConfig(n_expert // 4,
                                                    policy=DaliConfig(calibration=cal, prefetch=2)),
                         gating=gate(), recorder=rec)
    assert got == ref
    st, rep, n_slots, chunks, layers = out  # type: ignore[misc]
    live = rep["prefetch"]
    assert live["predictor"] == "residual-d1" and live["per_layer_cap"] == 2 and live["issued"] > 0
    pred, note = prefetch_predictor(fixture_model, cal, "residual", 1)
    assert note is None
    policy = DaliPrefetchPolicy(n_slots, layers, pred, n_expert, size=2, update=dali_default_update(n_expert))
    sim = replay(policy, rec.steps, chunk_bytes=chunks)
    pc = sim.prefetch
    assert pc is not None and (st["hits"], st["misses"]) == (sim.hits, sim.misses) and sim.hits > 0
    assert (live["issued"], live["useful"], live["preempted"]) == (pc.issued, pc.useful, pc.preempted)


def test_gate_predictor_when_the_calibration_has_no_mlp(tmp_path: Path) -> None:
    model = FIXTURE_MODELS[0]
    own = default_calibration_dir(model)
    assert own is not None
    card = json.loads((own / "card.json").read_text())
    card["predictors"]["files"] = [f for f in card["predictors"]["files"] if f["kind"] != "mlp"]
    (tmp_path / "card.json").write_text(json.dumps(card))
    pred, note = prefetch_predictor(model, tmp_path, "mlp", 2)
    assert pred.kind.value == "gate" and note is not None and "no mlp predictor at distance 2" in note
    pred, note = prefetch_predictor(model, None, "mlp", 1)
    assert pred.kind.value == "gate" and pred.distance == 1 and "has no calibration" in str(note)


def test_generate_json_reports_the_prefetcher() -> None:
    model = FIXTURE_MODELS[0]
    args = ["generate", str(model), "-p", "ROMEO:", "-n", "8", "--temp", "0", "--json"]
    res = CliRunner().invoke(cli, [*args, "--expert-slots", "4", "--alloc", "equal", "--policy", "promoe",
                                   "--prefetch-distance", "1", "--prefetch-extra", "2"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.splitlines()[-1])
    pf = out["cache"]["prefetch"]
    assert {"issued", "useful", "preempted", "goodpred"} <= pf.keys() and pf["predictor"] == "mlp-d1"
    assert pf["extra"] == 2 and pf["issued"] > 0 and 0.0 < pf["goodpred"] <= 1.0
    assert "policy promoe (predictor mlp-d1, top-k+2)" in res.output
    plain = json.loads(CliRunner().invoke(cli, args, catch_exceptions=False).stdout)
    assert out["tokens"] == plain["tokens"]
    res = CliRunner().invoke(cli, [*args, "--expert-slots", "4", "--policy", "lru", "--prefetch-distance", "1"])
    assert res.exit_code == 2 and "options of --policy promoe" in res.output
    # without --policy, promoe's options choose it
    res = CliRunner().invoke(cli, [*args, "--expert-slots", "4", "--prefetch-distance", "1"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[-1])["cache"]["policy"] == "promoe"


def test_profile_timing_scales_the_link_to_the_experts_bytes() -> None:
    from edgemoe.perf.model.costmodel import ModelShape
    from edgemoe.perf.model.link_timing import profile_timing
    from edgemoe.perf.model.profile import load_profile

    prof, ref = load_profile("rtx4060-laptop"), ModelShape.read(FIXTURE_MODELS[0])
    cpu = profile_timing(prof, ref, 1000.0, name="laptop")
    gpu = profile_timing(prof, ref, 1000.0, name="laptop", experts_on="gpu", pinned=True)
    for lt in (cpu, gpu):  # the other model copies an expert in as many layer times as the reference
        assert lt.timing.bandwidth * lt.timing.layer_s / 1000.0 == pytest.approx(lt.experts_per_layer)
        assert lt.timing.layer_s == lt.layer_s and "experts per layer time" in lt.label
    assert gpu.layer_s < cpu.layer_s  # the GPU computes the experts faster than the CPU


def test_route_steps_are_the_engines_ubatches() -> None:
    from edgemoe.analysis.trace import DECODE, PREFILL, Trace, route_steps

    T, L, k = 7, 2, 2
    tr = Trace(tokens=np.arange(T, dtype=np.int32), layers=np.array([3, 5], np.int32),
               ids=np.arange(T * L * k, dtype=np.int32).reshape(T, L, k), weights=np.ones((T, L, k), np.float32),
               phase=np.array([PREFILL] * 3 + [DECODE] * 2 + [PREFILL, DECODE], np.uint8),
               seq=np.array([0] * 5 + [1] * 2, np.int32), gate_inputs=np.ones((T, L, 4), np.float16))
    steps, decode = route_steps(tr, n_ubatch=2)
    assert [len(s[0][1]) for s in steps] == [2, 1, 1, 1, 1, 1] and decode == [False, False, True, True, False, True]
    assert [il for il, _, _ in steps[0]] == [3, 5] and steps[2][1][1].tolist() == [tr.ids[3, 1].tolist()]
    assert steps[0][0][2].shape == (2, 4)
