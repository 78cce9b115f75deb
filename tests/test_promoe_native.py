"""promoe inside llama.cpp (predicted prefetch) on the CPU stand-in: no Python per MoE layer, the in-graph predictor's
ids drive the loads, admission by bytes, and when the engine falls back to the routing hook.

The counters against PromoePolicy replayed are in test_prefetch_engine.py (test_live_counters_equal_the_replay,
native and hook); the RPC device, with and without the load worker, in test_cache_rpc.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from edgemoe.calibration.adaptive import default_calibration_dir
from edgemoe.errors import EdgeMoeError
from edgemoe.policies.copy_queue import CopyTiming
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, PromoeConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

from helpers.models import FIXTURE_MODELS

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type"
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def _stock(path: Path) -> list[int]:
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        return eng.generate(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens


def test_native_promoe_runs_without_a_python_hook(fixture_model: Path) -> None:
    ref = _stock(fixture_model)
    cal = default_calibration_dir(fixture_model)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4,
                                                    policy=PromoeConfig(calibration=cal)))
        assert cache is not None and eng.routing.hooks is None  # nothing calls back into Python
        # the calibration's mlp predictor of layer l+2 runs in the graph on layer l's router input
        layers = list(eng.info.moe_layers)
        assert eng.predictor_targets == layers[2:]
        eng.reset_control_stats()
        toks = eng.generate(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        ctl, st, pf = eng.control_stats(), cache.stats(), eng.experts.report()["prefetch"]
    assert toks == ref
    # llama.cpp's own callback stops at every cached layer of every ubatch (the last one only where it has tokens)
    assert ctl["n_host_syncs"] >= (ctl["n_ubatch"] - 1) * (len(layers) - 1) > 0
    assert pf["path"] == "native" and pf["predictor"] == "mlp-d2" and pf["issued"] > 0 and pf["useful"] > 0
    assert 0.0 < pf["goodpred"] <= 1.0 and st["hits"] > 0 and st["prefetches"] >= pf["issued"]
    assert pf["weights"] == "f16" and pf["predictor_bytes"] > 0  # the calibration's float16 weights as they are


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
def test_native_promoe_with_other_predictor_weights(weights: str) -> None:
    path = FIXTURE_MODELS[0]
    ref = _stock(path)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4,
                                            policy=PromoeConfig(calibration=default_calibration_dir(path),
                                                                weights=weights)))
        toks = eng.generate(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        pf = eng.experts.report()["prefetch"]
    assert toks == ref and pf["weights"] == weights and pf["issued"] > 0 and pf["goodpred"] > 0.3


def test_admission_by_bytes_queues_nothing_that_cannot_arrive(fixture_model: Path) -> None:
    """admit_bytes below one expert's bytes: no prediction nor refill is queued, the layers run from the model's
    tensors (stock output, no hit); a budget of many experts queues as without admission."""
    ref = _stock(fixture_model)
    cal = default_calibration_dir(fixture_model)
    issued = {}
    for admit in (1.0, 1e12, 0.0):
        with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
            cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4,
                                                        policy=PromoeConfig(calibration=cal)))
            assert cache is not None
            assert native.moe_cache_set_predicted_prefetch(eng.handle.ctx, False, admit) == 0
            toks = eng.generate(PROMPT, max_tokens=12, sampling=GREEDY, ignore_eog=True).tokens
            st, pf = cache.stats(), eng.experts.report()["prefetch"]
        assert toks == ref[:12]
        issued[admit] = (pf["issued"], st["loads"], st["hits"])
    assert issued[1.0] == (0, 0, 0)
    assert issued[1e12] == issued[0.0] and issued[0.0][0] > 0


def test_promoe_falls_back_to_the_hook_where_it_cannot_run_natively(fixture_model: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    cal = default_calibration_dir(fixture_model)
    slow = CopyTiming(bandwidth=1e6, layer_s=1e-3)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        n = eng.info.n_expert // 4
        # a copy timing paces the stand-in's copies: only the hook's model of the queue does that
        with caplog.at_level("INFO", logger="edgemoe.runtime.prefetcher"):
            eng.enable_expert_cache(CacheConfig(n, policy=PromoeConfig(calibration=cal, copy_timing=slow)))
        assert eng.routing.hooks is not None and "copy timing" in caplog.text and eng.predictor_targets == []
        assert "copy timing" in str(eng.experts.hook_reason) and eng.experts.report()["prefetch"]["path"] == "hook"
        with pytest.raises(EdgeMoeError, match="cannot run inside llama.cpp here: a copy timing"):
            eng.enable_expert_cache(CacheConfig(n, policy=PromoeConfig(calibration=cal, copy_timing=slow,
                                                                       native=True)))
        eng.enable_expert_cache(CacheConfig(n, policy=PromoeConfig(calibration=cal, native=False)))
        assert eng.routing.hooks is not None and eng.experts.hook_reason is not None and eng.predictor_targets == []
        # native again, then no cache: the predictors leave the graph with it
        eng.enable_expert_cache(CacheConfig(n, policy=PromoeConfig(calibration=cal)))
        assert eng.routing.hooks is None and eng.predictor_targets
        eng.enable_expert_cache(None)
        assert eng.predictor_targets == [] and eng.experts is None


def test_layers_without_slots_still_predict(fixture_model: Path) -> None:
    """Slots per layer as --alloc dp may give them: layers with none route as stock, but llama.cpp still stops at
    those that predict a later layer (predicted prefetch hands their routing to its callback) and queues the predictions;
    the counters equal PromoePolicy replayed, which predicts from every layer."""
    from edgemoe.policies.promoe import PromoePolicy
    from edgemoe.policies.replay import replay
    from edgemoe.runtime.prefetcher import prefetch_predictor

    from helpers.recorders import RouteRecorder

    ref = _stock(fixture_model)
    cal = default_calibration_dir(fixture_model)
    runs = []
    for record in (False, True):
        rec = RouteRecorder()
        with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
            layers, n = list(eng.info.moe_layers), eng.info.n_expert // 4
            slots = {il: (0 if j < 2 or j == 5 else n) for j, il in enumerate(layers)}  # sources 0, 1, 5 empty
            cache = eng.enable_expert_cache(CacheConfig(slots,
                                                        policy=PromoeConfig(calibration=cal, weights="f32")))
            assert cache is not None and eng.routing.hooks is None
            if record:
                eng.set_policies([rec])  # a routing hook at every layer, before llama.cpp's promoe step
            toks = eng.generate(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
            st, pf, chunks = cache.stats(), eng.experts.report()["prefetch"], cache.chunk_bytes
        assert toks == ref and pf["path"] == "native"
        runs.append((st["hits"], st["misses"], pf["issued"], pf["useful"], pf["preempted"]))
    pred, _ = prefetch_predictor(fixture_model, cal, "mlp", 2)
    sim = replay(PromoePolicy(slots, layers, pred), rec.steps, chunk_bytes=chunks)
    assert sim.prefetch is not None and sim.prefetch.useful > 0
    want = (sim.hits, sim.misses, sim.prefetch.issued, sim.prefetch.useful, sim.prefetch.preempted)
    assert runs[0] == runs[1] == want  # without a hook too: the empty layers 0 and 1 predicted layers 2 and 3


def test_a_refused_predictor_leaves_no_cache_behind() -> None:
    """Bad predictor weights: a one-line error, and the engine goes on as without a cache (stock tokens)."""
    path = FIXTURE_MODELS[0]
    ref = _stock(path)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        with pytest.raises(EdgeMoeError, match="predictor weights 'f8'"):
            eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4,
                                                policy=PromoeConfig(calibration=default_calibration_dir(path),
                                                                    weights="f8")))
        assert eng.experts is None and eng.routing.hooks is None and eng.predictor_targets == []
        assert eng.generate(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens == ref
