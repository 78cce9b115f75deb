"""Expert-to-slot tables in the graph: the expert cache with no host sync per MoE layer.

With no Python policy set, the cached layers split their routed ids with two table lookups inside
the graph, and lru runs natively after each ubatch. Checked against stock (bitwise, same CPU kernels
on both sides as in test_expert_cache.py), against the Python LruPolicy replayed on the same routes,
and through the control counters (no routing-callback stop at all).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.verify import FnPolicy
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.policies.residency import LruPolicy, make_policy, replay_policy
from edgemoe.runtime.cache_config import CacheConfig, DaliConfig, LruConfig, ManualConfig, calibrated_config
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

from helpers.recorders import StepRecorder

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def _generate(path: Path, cache: CacheConfig | None, policies: list | None = None,
              gating: GatingPolicy | None = None) -> tuple[list[int], dict | None, dict, str | None]:
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        c = eng.enable_expert_cache(cache) if cache is not None else None
        if policies:
            eng.set_policies(policies)
        if gating is not None:
            eng.set_gating(gating)
        toks = eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True).tokens
        if c is not None:
            c.sync()
        return toks, (c.stats() if c is not None else None), eng.control_stats(), eng.gating_path


# the fixture in the default suite; the other architectures' tiny models in the long one (`make test-long`)
PRESETS = ["fixture", *(pytest.param(p, marks=pytest.mark.long) for p in ("tiny-qwen2moe", "tiny-deepseek2", "tiny-olmoe"))]


@pytest.mark.parametrize("preset", PRESETS)
def test_native_lru_generates_as_stock_without_host_syncs(preset: str, fixture_model: Path, make_tiny_gguf) -> None:
    path = fixture_model if preset == "fixture" else make_tiny_gguf(preset)
    ref, _, _, _ = _generate(path, None)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        n_expert, n_moe = eng.info.n_expert, len(eng.info.moe_layers)
    for slots in (1, n_expert // 2, n_expert):
        got, st, control, _ = _generate(path, CacheConfig(slots, policy=LruConfig()))
        assert got == ref, f"{path.name}, {slots} slots"
        assert control["n_host_syncs"] == 0 and control["n_ubatch"] > 0
        assert st["hits"] > 0 and st["loads"] > 0
        # the stand-in copies at once while the LRU issues (host time); no stream waits without a device
        assert st["issue_s"] > 0 and st["load_waits"] == 0
        if slots == n_expert:
            assert st["loads"] <= n_expert * n_moe  # with a slot for every expert nothing is evicted


@pytest.mark.parametrize("preset", PRESETS)
def test_native_dali_generates_as_stock_without_host_syncs(preset: str, fixture_model: Path, make_tiny_gguf) -> None:
    """dali's native twin (window replacement) runs after each ubatch, like the native LRU; with blocking loads it
    runs in the routing callback (a host sync per MoE layer and ubatch)."""
    path = fixture_model if preset == "fixture" else make_tiny_gguf(preset)
    ref, _, _, _ = _generate(path, None)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        n_expert = eng.info.n_expert
    for slots in (1, n_expert // 2, n_expert):
        got, st, control, _ = _generate(path, CacheConfig(slots, policy=DaliConfig()))
        assert got == ref, f"{path.name}, {slots} slots"
        assert control["n_host_syncs"] == 0 and st["hits"] > 0 and st["loads"] > 0
    got, st, control, _ = _generate(path, CacheConfig(n_expert // 2, policy=DaliConfig(blocking=True)))
    assert got == ref and control["n_host_syncs"] > 0 and st["hits"] > 0


@pytest.mark.parametrize("window,update", [(4, 1), (1, 3), (16, 2)])
def test_native_dali_decides_as_the_python_policy(window: int, update: int, fixture_model: Path) -> None:
    """Counters of the native DALI = DaliPolicy (non-blocking) replayed on the same run's routes, in
    ubatches of 16 prompt tokens (a window counts tokens) then single decode tokens."""
    config = dict(PLAIN, n_ubatch=16)
    recorder = StepRecorder()
    with Engine(fixture_model, LoadConfig(**config)) as eng:
        eng.set_policies([recorder])
        ref = eng.generate(TEXT[:120], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        n_slots = {il: 5 for il in eng.info.moe_layers}
        n_expert = eng.info.n_expert
    with Engine(fixture_model, LoadConfig(**config)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(5, policy=DaliConfig(window=window, update=update)))
        got = eng.generate(TEXT[:120], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        cache.sync()
        st = cache.stats()
        assert eng.control_stats()["n_host_syncs"] == 0
    assert got == ref and max(len(r[1]) for r in recorder.steps[0]) == 16
    sim = replay_policy(make_policy("dali", n_slots, n_expert=n_expert, window=window, update=update), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert sim.hits > 0 and sim.misses > 0


def test_native_settings_refuse_what_they_cannot_use(fixture_model: Path) -> None:
    from edgemoe.runtime import native

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        eng.enable_expert_cache(CacheConfig(4, policy=ManualConfig()))
        assert native.moe_cache_set_window_replacement(eng.handle.ctx, 0, 1) == -1
        assert native.moe_cache_set_window_replacement(eng.handle.ctx, 4, 0) == -1
        assert native.moe_cache_set_window_replacement(eng.handle.ctx, 4, 2) == 0
        # staging buffers: a negative count is refused; on the stand-in (no copy stream) any count is accepted
        assert native.moe_cache_set_staging(eng.handle.ctx, -1) == -1 and native.moe_cache_set_staging(eng.handle.ctx, 2) == 0


@pytest.mark.parametrize("policy", ["lru", "dali", "static"])
def test_uneven_slots_per_layer_generate_as_stock_and_as_replayed(policy: str, fixture_model: Path) -> None:
    """A per-layer allocation (some layers with none): stock tokens, and the counters of the policy
    replayed on the same routes (layers without slots count nowhere)."""
    from edgemoe.calibration.adaptive import default_calibration_dir

    recorder = StepRecorder()
    ref, _, _, _ = _generate(fixture_model, None, policies=[recorder])
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        moe, n_expert = list(eng.info.moe_layers), eng.info.n_expert
    slots = {il: [0, 1, n_expert // 2, n_expert][i % 4] for i, il in enumerate(moe)}
    cal = default_calibration_dir(fixture_model)
    got, st, control, _ = _generate(fixture_model, CacheConfig(slots, policy=calibrated_config(policy, cal)))
    assert got == ref and st["slots_per_layer"] == slots and st["slots_total"] == sum(slots.values())
    assert control["n_host_syncs"] == 0
    sim = replay_policy(make_policy(policy, slots, calibration=cal, n_expert=n_expert), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads) and sim.hits > 0


def test_native_lru_decides_as_the_python_policy(fixture_model: Path) -> None:
    """Counters of the native LRU = LruPolicy (non-blocking) replayed on the same run's routes."""
    recorder = StepRecorder()

    ref, _, _, _ = _generate(fixture_model, None, policies=[recorder])  # the routes (hook, no cache)
    got, st, control, _ = _generate(fixture_model, CacheConfig(6, policy=LruConfig()))
    assert got == ref and control["n_host_syncs"] == 0
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        n_slots = {il: 6 for il in eng.info.moe_layers}
    sim = replay_policy(LruPolicy(n_slots), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert sim.misses > 0 and sim.hits > 0


def test_gating_and_native_lru_together(fixture_model: Path) -> None:
    gate = GatingPolicy(GatingRule.SER, 0.5)
    no_cache, _, _, _ = _generate(fixture_model, None, gating=GatingPolicy(GatingRule.SER, 0.5))
    got, st, control, path = _generate(fixture_model, CacheConfig(4, policy=LruConfig()), gating=gate)
    assert path == "graph" and got == no_cache
    assert control["n_host_syncs"] == 0 and control["n_dropped"] > 0 and st["hits"] > 0


def test_a_python_policy_takes_the_cache_back_into_the_hook(fixture_model: Path) -> None:
    ref, _, _, _ = _generate(fixture_model, None)
    seen: list[int] = []
    got, st, control, _ = _generate(fixture_model, CacheConfig(4, policy=LruConfig()),
                                    policies=[FnPolicy(lambda r: seen.append(r.layer))])
    assert got == ref and st["hits"] > 0
    assert control["n_host_syncs"] == len(seen) > 0  # one stop per cached MoE layer and ubatch
    # and back: without the policy the same engine runs the cache in the graph again
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        eng.enable_expert_cache(CacheConfig(4, policy=LruConfig()))
        eng.set_policies([FnPolicy(lambda r: None)])
        first = eng.generate(TEXT[:80], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        eng.set_policies(None)
        eng.reset_control_stats()
        eng.reset()
        again = eng.generate(TEXT[:80], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        assert eng.control_stats()["n_host_syncs"] == 0
    assert first == again == ref[:16]


def test_tables_across_ubatches_of_one_decode(fixture_model: Path) -> None:
    """A prefill of several ubatches: each one's routes are processed before the next uploads its tables."""
    config = dict(PLAIN, n_batch=64, n_ubatch=16)
    recorder = StepRecorder()

    with Engine(fixture_model, LoadConfig(**config)) as eng:
        toks = eng.tokenize(TEXT)[:56]
        eng.set_policies([recorder])
        ref = np.array(eng.eval_logits(toks))
        n_slots = {il: 5 for il in eng.info.moe_layers}
    with Engine(fixture_model, LoadConfig(**config)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(5, policy=LruConfig()))
        got = np.array(eng.eval_logits(toks))  # 56 tokens: ubatches of 16, 16, 16, 8
        cache.sync()
        st = cache.stats()
        assert eng.control_stats()["n_host_syncs"] == 0
    assert np.array_equal(got, ref)
    assert len(recorder.steps) == 4
    sim = replay_policy(LruPolicy(n_slots), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads) and sim.hits > 0
