"""Expert cache and split execution against stock, on the CPU stand-in cache device.

Stock here is the same library with no hook and no cache (the graph llama.cpp builds), loaded with
use_extra_bufts=False like the cached engine, so both use the same CPU kernels: equality is bitwise.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.verify import FnPolicy
from edgemoe.errors import InvalidConfigError
from edgemoe.policies.residency import Load, LruPolicy, StaticPolicy, make_policy, replay_policy, used_experts
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime.cache_config import (
    CacheConfig,
    LruConfig,
    ManualConfig,
    calibrated_config,
    policy_config,
)
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.expert_cache import ExpertCacheError
from edgemoe.runtime.sampling import GREEDY

from helpers.cache_runs import PLAIN, TEXT, partial_copy_run, run_prefill_and_steps
from helpers.models import FIXTURE_MODELS
from helpers.recorders import StepRecorder

SYNTH = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-deepseek2", "tiny-mixtral", "tiny-olmoe"]


def _models(make_tiny_gguf) -> list[Path]:  # type: ignore[no-untyped-def]
    return list(FIXTURE_MODELS) + [make_tiny_gguf(p) for p in SYNTH]


def test_random_residency_equals_stock(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    for path in _models(make_tiny_gguf):
        with Engine(path, LoadConfig(**PLAIN)) as eng:
            toks = (eng.tokenize(TEXT) * 2)[:76]
            n_expert = eng.info.n_expert
        ref_pre, ref_steps, _ = run_prefill_and_steps(path, toks)
        for slots in (1, n_expert // 2, n_expert):
            cfg = CacheConfig(slots, policy=LruConfig())
            pre, steps, st = run_prefill_and_steps(path, toks, cache=cfg, rng=rng)
            assert np.array_equal(pre, ref_pre), f"{path.name}: prefill, {slots} slots"
            for i, (a, b) in enumerate(zip(steps, ref_steps, strict=False)):
                assert np.array_equal(a, b), f"{path.name}: decode step {i}, {slots} slots"
            assert st is not None and st["hits"] > 0 and st["loads"] > 0


@pytest.mark.parametrize("policy,blocking", [("lru", False), ("lru", True), ("static", None),
                                             ("dali", False), ("dali", True)])
def test_every_policy_generates_as_stock(fixture_model: Path, policy: str, blocking: bool | None) -> None:
    from edgemoe.calibration.adaptive import default_calibration_dir

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        ref = eng.generate(TEXT[:60], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
    options = {} if blocking is None else {"blocking": blocking}  # static never loads after the start
    cfg = CacheConfig(4, policy=calibrated_config(policy, default_calibration_dir(fixture_model), **options))
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(cfg)
        got = eng.generate(TEXT[:60], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        st = cache.stats()
    assert got == ref
    assert st["hits"] > 0 and 0.0 < st["hit_rate"] < 1.0
    assert st["bytes_uploaded"] > 0 and st["gpu_expert_share"] == st["hit_rate"]


@pytest.mark.parametrize("policy,blocking", [("lru", False), ("lru", True), ("dali", False), ("dali", True)])
def test_native_counters_equal_the_policy_replayed_on_the_trace(fixture_model: Path, policy: str,
                                                                blocking: bool) -> None:
    """The C side computes from the slots the Python policy believes are resident."""
    recorder = StepRecorder()

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(6, policy=policy_config(policy, blocking=blocking)))
        eng.set_policies([recorder])  # runs before the cache controller, sees the same ids
        eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True)
        cache.sync()  # the last step's prefetches complete (the simulation applies them after the step)
        st = cache.stats()
        n_slots, n_expert = dict(cache.n_slots), eng.info.n_expert
    sim = replay_policy(make_policy(policy, n_slots, blocking=blocking, n_expert=n_expert), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert sim.hits > 0 and sim.loads > 0
    if policy != "lru":
        return
    prefill = replay_policy(LruPolicy(n_slots, blocking=blocking), recorder.steps[:1])
    if blocking:
        # a decode step's experts (k <= slots) are all loaded before their layer runs: misses only in
        # prefill, whose ubatch uses more experts than there are slots
        assert sim.misses == prefill.misses
    else:
        assert sim.misses > 0


def test_lru_policy_on_hand_made_routes() -> None:
    pol = LruPolicy({3: 2})
    assert pol.on_route(3, np.array([[5, 7]])) == [Load(3, 5, 0), Load(3, 7, 1)]
    assert pol.on_route(3, np.array([[7, -1]])) == []  # hit; -1 is a dropped slot
    assert pol.on_route(3, np.array([[9, 7]])) == [Load(3, 9, 0)]  # 5 was least recently used
    assert pol.resident(3) == {7, 9}
    assert pol.on_route(4, np.array([[1, 2]])) == []  # a layer without slots
    # more misses in one ubatch than slots: only the survivors are copied
    assert pol.on_route(3, np.array([[1, 2], [3, 4]])) == [Load(3, 3, 1), Load(3, 4, 0)]
    # hits are touched before misses evict: a used expert is never evicted by its own step
    pol = LruPolicy({0: 2})
    pol.on_route(0, np.array([[1, 2]]))  # 1 is now least recently used
    assert pol.on_route(0, np.array([[3, 1]])) == [Load(0, 3, 1)] and pol.resident(0) == {1, 3}
    assert used_experts(np.array([[4, 2], [2, -1]])) == [4, 2]


def test_static_policy_places_the_most_frequent() -> None:
    freq = {0: np.array([5, 1, 9, 9, 0]), 2: np.array([0, 0, 0, 1, 2])}
    pol = StaticPolicy(freq, {0: 3, 2: 1})
    assert pol.initial_loads() == [Load(0, 0, 0), Load(0, 2, 1), Load(0, 3, 2), Load(2, 4, 0)]
    assert pol.on_route(0, np.array([[1, 4]])) == []
    res = replay_policy(pol, [[(0, np.array([[2, 1]])), (2, np.array([[4, 3]]))]])
    assert (res.hits, res.misses, res.loads) == (2, 2, 4)


def test_cache_beside_repacked_cpu_experts(fixture_model: Path) -> None:
    """Loads read the GGUF's bytes, so the CPU keeps its repacked experts (different kernels: close, not bitwise)."""
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        toks = eng.tokenize(TEXT)[:48]
        ref = np.array(eng.eval_logits(toks))
        ref_gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 2, policy=LruConfig(blocking=True)))
        got = np.array(eng.eval_logits(toks))
        got_gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        st = cache.stats()
    nmse = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
    assert nmse < 1e-5, nmse
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.97 and got_gen == ref_gen
    assert st["hits"] > 0


def test_long_greedy_run_equals_stock_with_the_same_cpu_kernels(fixture_model: Path) -> None:
    """600 greedy tokens with an lru cache of 4 slots: identical to stock when both sides run the plain
    CPU kernels (repacking off). With repacking on, the output first differs after a few hundred
    tokens (docs/expert-cache.md has the measured bound): only the kernels differ, not the split."""
    cfg = LoadConfig(n_ctx=768, use_extra_bufts=False)
    with Engine(fixture_model, cfg) as eng:
        ref = eng.generate("ROMEO:", max_tokens=600, sampling=GREEDY, ignore_eog=True).tokens
    with Engine(fixture_model, cfg) as eng:
        cache = eng.enable_expert_cache(CacheConfig(4, policy=LruConfig()))
        got = eng.generate("ROMEO:", max_tokens=600, sampling=GREEDY, ignore_eog=True).tokens
        st = cache.stats()
    assert got == ref
    assert st["hits"] > 0 and st["misses"] > 0


def test_cache_errors(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=128)) as eng:
        with pytest.raises(ExpertCacheError, match="`expert_slots"):
            eng.enable_expert_cache(CacheConfig(eng.info.n_expert + 1))
        with pytest.raises(InvalidConfigError, match="unknown cache policy"):
            policy_config("fifo")
        with pytest.raises(InvalidConfigError, match="the static policy has no option 'blocking'"):
            policy_config("static", blocking=True)
        with pytest.raises(ExpertCacheError, match=r"`expert_slots=99` \(layer 3\)"):
            eng.enable_expert_cache(CacheConfig({3: 99}))
        with pytest.raises(ExpertCacheError, match="not MoE layers"):
            eng.enable_expert_cache(CacheConfig({eng.info.n_layer + 4: 1}))
        cache = eng.enable_expert_cache(CacheConfig(2, policy=ManualConfig()))
        with pytest.raises(ExpertCacheError, match="slot 5"):
            cache.load(Load(eng.info.moe_layers[0], 1, 5))


def test_cache_with_dropped_experts_equals_drops_alone(fixture_model: Path) -> None:
    """Gating and the cache together: a dropped slot is computed nowhere."""
    def drop_last(r: RouteRecord) -> None:
        r.ids[:, -1] = -1
        r.weights[:, -1] = 0.0

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        toks = eng.tokenize(TEXT)[:40]
        eng.set_policies([FnPolicy(drop_last)])
        ref = np.array(eng.eval_logits(toks))
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert, policy=LruConfig(blocking=True)))
        eng.set_policies([FnPolicy(drop_last)])
        got = np.array(eng.eval_logits(toks))
        st = cache.stats()
    assert np.array_equal(got, ref)
    k = eng.info.n_expert_used
    assert st["hits"] + st["misses"] == len(toks) * (k - 1) * len(eng.info.moe_layers)


def test_prefetch_is_used_only_after_its_copy_and_its_layer(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(2, policy=ManualConfig()))
        toks = eng.tokenize(TEXT)[:8]
        eng.feed(toks[:4])
        layer = eng.info.moe_layers[1]
        cache.load(Load(layer, 3, 0))
        assert cache.state(layer, 3) == "resident"
        cache.prefetch(Load(layer, 5, 0))  # evicts 3 now
        assert (cache.state(layer, 3), cache.state(layer, 5)) == ("absent", "queued")
        cache.prefetch(Load(layer, 6, 1), priority=1)
        assert cache.issue(1) == 1  # the urgent load's first chunk goes first
        assert (cache.state(layer, 6), cache.state(layer, 5)) == ("copying", "queued")
        cache.prefetch(Load(layer, 7, 0))  # supersedes the queued load into slot 0
        assert cache.state(layer, 5) == "absent"
        assert cache.issue() == 5  # 2 chunks left of 6, 3 of 7 (gate, up, down)
        assert cache.slots(layer)[6] == -1  # all chunks issued, but its layer has not run since
        eng.feed(toks[4:5])
        assert cache.slots(layer)[6] == 1 and cache.slots(layer)[7] == 0
        st = cache.stats()
        assert (st["prefetches"], st["loads"], st["chunks"], st["preempted"]) == (3, 3, 9, 1)  # 5 was preempted


def test_partial_copies_are_never_computed(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    """Slots with some chunks of a new expert issued (the rest stale) stay out of compute."""
    rng = np.random.default_rng(1)
    for path in [*FIXTURE_MODELS, make_tiny_gguf("tiny-qwen2moe")]:
        ref, got, st, _ = partial_copy_run(path, rng, 4)
        assert np.array_equal(got, ref), path.name
        assert st["hits"] > 0 and st["misses"] > 0 and st["chunks"] > st["loads"]


def test_overlap_is_off_with_llama_cpps_concurrent_streams(fixture_model: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """GGML_CUDA_GRAPH_OPT=1 (llama.cpp's opt-in concurrent CUDA streams) could fork inside an overlapped split:
    the cache then runs its two branches one after the other, says so, and the tokens stay stock's."""
    cfg = CacheConfig(4, policy=LruConfig())
    assert cfg.overlap_on({}) and cfg.overlap_on({"GGML_CUDA_GRAPH_OPT": "0"})
    assert not cfg.overlap_on({"GGML_CUDA_GRAPH_OPT": "1"})
    assert not CacheConfig(4, policy=LruConfig(), overlap=False).overlap_on({})
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        want = eng.generate("ROMEO:", max_tokens=8, sampling=GREEDY).tokens
    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING"):
        mp.setenv("GGML_CUDA_GRAPH_OPT", "1")
        with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
            eng.enable_expert_cache(cfg)
            assert eng.generate("ROMEO:", max_tokens=8, sampling=GREEDY).tokens == want
    assert "GGML_CUDA_GRAPH_OPT=1" in caplog.text
