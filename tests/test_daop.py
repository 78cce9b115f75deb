"""DAOP (edgemoe.policies.daop, .degrade): the swap rule on hand-made counts, the policy on hand-made
routes, graceful degradation on synthetic routes; then on the fixtures with the CPU-buffer cache: greedy
generation equals stock, the native counters equal the policy replayed on the run's routes, and
degradation changes only the picks of experts that are not resident."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.calibration.adaptive import default_calibration_dir
from edgemoe.policies.daop import DaopError, DaopPolicy, PromptSwapResidency, initial_placement, swap_pairs
from edgemoe.policies.degrade import DegradeError, GracefulDegradation, degrade, rule_weights
from edgemoe.policies.residency import Load, make_policy, replay_policy
from edgemoe.policies.route import RouteRecord, WeightRule
from edgemoe.runtime.cache_config import CacheConfig, DaopConfig, ManualConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

from helpers.recorders import StepRecorder

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


# -- the swap rule (Algorithm 1) ------------------------------------------------------------------
def test_swap_pairs_hot_cpu_experts_meet_cold_gpu_experts() -> None:
    counts = np.array([0, 5, 3, 10, 0, 2])
    # CPU experts by count: 3 (10), 1 (5), 5 (2); GPU experts by count: 0 (0), 4 (0), 2 (3)
    assert swap_pairs(counts, {0, 2, 4}) == [(3, 0), (1, 4)]  # 2 > 1.05 * 3 fails: the rest would too
    assert swap_pairs(counts, {0, 2, 4}, max_pairs=1) == [(3, 0)]


def test_swap_threshold_is_strict_and_1_05() -> None:
    resident = {0}
    assert swap_pairs(np.array([20, 21, 0, 0]), resident) == []  # 21 > 21.0 fails
    assert swap_pairs(np.array([20, 22, 0, 0]), resident) == [(1, 0)]  # 22 > 21
    assert swap_pairs(np.array([20, 21, 0, 0]), resident, threshold=1.0) == [(1, 0)]
    assert swap_pairs(np.zeros(4, int), resident) == []  # two unused experts never swap
    with pytest.raises(DaopError, match="SwapInOut"):
        swap_pairs(np.zeros(4, int), resident, threshold=0.9)
    with pytest.raises(DaopError, match="SwapInOut"):
        DaopPolicy({}, {}, 4, threshold=0.9)


def test_swap_num_is_half_the_experts() -> None:
    counts = np.array([0, 0, 0, 0, 9, 9, 9, 9])  # every GPU expert idle, every CPU expert busy
    assert len(swap_pairs(counts, {0, 1, 2, 3})) == 4  # SwapNum = 0.5 * 8
    counts = np.array([0] * 6 + [9] * 6)
    assert len(swap_pairs(counts, set(range(6)))) == 6
    counts = np.array([0] * 3 + [9] * 7)
    assert swap_pairs(counts, {0, 1, 2}) == [(3, 0), (4, 1), (5, 2)]  # fewer GPU experts than SwapNum


def test_initial_placement_takes_the_most_frequent_lower_id_on_ties() -> None:
    assert initial_placement(np.array([1, 5, 5, 0, 7]), 3) == [1, 2, 4]
    assert initial_placement(np.array([1, 5, 5, 0, 7]), 0) == []


# -- the policy on hand-made routes ----------------------------------------------------------------
def test_daop_swaps_once_per_prompt_at_the_first_decode_step() -> None:
    freq = {0: np.array([9, 8, 0, 0, 0, 0]), 1: np.array([0, 0, 0, 0, 5, 9])}
    pol = DaopPolicy(freq, {0: 2, 1: 2}, n_expert=6)
    assert pol.initial_loads() == [Load(0, 0, 0), Load(0, 1, 1), Load(1, 4, 0), Load(1, 5, 1)]
    prompt = np.array([[2, 3], [2, 0], [3, 2]])  # layer 0: 2 x3, 3 x2, 0 x1, 1 x0
    assert pol.on_route(0, prompt) == [] and pol.on_route(1, np.array([[4, 5], [4, 5], [4, 5]])) == []
    assert pol.on_route(0, np.array([[0, 1], [1, 0]])) == []  # a second ubatch of the same prompt
    # layer 0's counts: 0: 3, 1: 2, 2: 3, 3: 2 -> 2 in for 1 (3 > 2.1), then 3 vs 0 (2 > 3.15) fails
    assert pol.on_route(0, np.array([[5, 4]])) == [Load(0, 2, 1)]
    assert pol.on_route(1, np.array([[0, 1]])) == []  # layer 1's prompt used only its resident experts
    assert pol.resident(0) == {0, 2} and pol.n_prompts == 1 and pol.n_swaps == 1
    for _ in range(3):  # decoding never moves anything
        assert pol.on_route(0, np.array([[3, 4]])) == [] and pol.on_route(1, np.array([[0, 1]])) == []
    # the next prompt starts counting afresh: layer 0 3: 2, 4: 1, 5: 1; layer 1 0: 2, 1: 1, 2: 1
    assert pol.on_route(0, np.array([[3, 4], [3, 5]])) == [] and pol.on_route(1, np.array([[0, 1], [0, 2]])) == []
    assert pol.on_route(0, np.array([[0, 1]])) == [Load(0, 3, 0), Load(0, 4, 1)]  # 4, 5 tie: the lower id
    assert pol.on_route(1, np.array([[0, 1]])) == [Load(1, 0, 0), Load(1, 1, 1)]
    assert pol.resident(0) == {3, 4} and pol.resident(1) == {0, 1} and pol.n_prompts == 2


def test_daop_last_layer_with_one_prompt_token_is_still_a_prompt_step() -> None:
    """In a generation llama.cpp routes only the last prompt token through the last layer."""
    pol = DaopPolicy({0: np.array([1, 0, 0]), 1: np.array([1, 0, 0])}, {0: 1, 1: 1}, n_expert=3)
    pol.on_route(0, np.array([[1], [1]]))
    pol.on_route(1, np.array([[2]]))  # one row, but the step's first layer had two
    assert pol.on_route(0, np.array([[0]])) == [Load(0, 1, 0)]
    assert pol.on_route(1, np.array([[0]])) == [Load(1, 2, 0)]


def test_daop_replays_through_simulate_blocking_or_not() -> None:
    freq = {0: np.array([3, 2, 1, 0])}
    steps = [[(0, np.array([[3], [3], [2]]))], [(0, np.array([[3]]))], [(0, np.array([[3]]))]]
    live = replay_policy(DaopPolicy(freq, {0: 2}, 4), steps)
    # 2 initial loads, then 3 and 2 swap in for 0 and 1 at the first decode step, used from the next one
    assert (live.hits, live.misses, live.loads) == (1, 4, 4)
    blocking = replay_policy(DaopPolicy(freq, {0: 2}, 4, blocking=True), steps)
    assert (blocking.hits, blocking.misses, blocking.loads) == (2, 3, 4)


def test_make_policy_daop_reads_decode_frequencies(fixture_model: Path) -> None:
    cal = default_calibration_dir(fixture_model)
    d = np.load(cal / "router_frequency.npz")
    n_expert = int(d["counts"].shape[1])
    pol = make_policy("daop", {0: n_expert // 4}, calibration=cal, n_expert=n_expert)
    assert isinstance(pol, DaopPolicy)
    assert pol.resident(0) == set(initial_placement(d["decode_counts"][0], n_expert // 4))
    with pytest.raises(Exception, match="calibration"):
        make_policy("daop", {0: 2}, n_expert=n_expert)


# -- graceful degradation on synthetic routes ------------------------------------------------------
def _route(ids: np.ndarray, probs: np.ndarray, rule: WeightRule = WeightRule.NORM) -> RouteRecord:
    sel = np.take_along_axis(probs, ids, axis=1)
    w = rule_weights(sel, ids >= 0, rule, 1.0)
    return RouteRecord(layer=0, ids=ids.astype(np.int32), weights=w, probs=probs.astype(np.float32),
                       gate_inp=None, n_expert=probs.shape[1], weight_rule=rule)


class _Fixed:
    def __init__(self, res: set[int]) -> None:
        self.res = res

    def resident(self, layer: int) -> set[int]:
        return self.res


def test_degrade_replaces_only_non_resident_picks_with_close_resident_ones() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_expert, k, n_tok = 8, 3, 5
        probs = rng.dirichlet(np.ones(n_expert), size=n_tok)
        ids = np.argsort(-probs, axis=1)[:, :k]
        resident = rng.random(n_expert) < 0.5
        ratio = float(rng.choice([0.3, 0.7, 0.9, 1.0]))
        new, replaced = degrade(ids, probs, resident, ratio=ratio)
        assert np.array_equal(new[~replaced], ids[~replaced])  # nothing else changes
        assert not resident[ids[replaced]].any() and resident[new[replaced]].all()
        assert (np.take_along_axis(probs, new, 1)[replaced] >= ratio * np.take_along_axis(probs, ids, 1)[replaced]).all()
        assert not replaced[:, 0].any()  # the top-1 expert is kept
        for row in new:
            assert len(set(row)) == k  # no expert twice in a token


def test_degrade_pairs_lowest_cpu_expert_with_best_resident_candidate() -> None:
    probs = np.array([[0.40, 0.25, 0.20, 0.15]])
    ids = np.array([[0, 1, 2]])  # 1 and 2 on the CPU, 3 resident
    resident = np.array([False, False, False, True])
    new, rep = degrade(ids, probs, resident, ratio=0.7)  # 0.15 >= 0.7 * 0.20
    assert new.tolist() == [[0, 1, 3]] and rep.tolist() == [[False, False, True]]
    new, rep = degrade(ids, probs, resident, ratio=0.8)  # 0.15 < 0.16
    assert new.tolist() == [[0, 1, 2]] and not rep.any()
    resident = np.array([True, False, False, False])
    new, rep = degrade(ids, probs, resident, ratio=0.1)  # 0 is resident but already selected
    assert not rep.any()
    with pytest.raises(DegradeError):
        degrade(ids, probs, resident, ratio=0.0)


def test_degradation_policy_reweights_changed_tokens_by_the_layer_rule() -> None:
    probs = np.array([[0.40, 0.25, 0.20, 0.15], [0.5, 0.3, 0.1, 0.1]])
    for rule in (WeightRule.NORM, WeightRule.AS_IS):
        r = _route(np.array([[0, 1, 2], [0, 3, 1]]), probs, rule)
        before = r.weights.copy()
        pol = GracefulDegradation(_Fixed({0, 3}), ratio=0.7, decode_only=False)
        pol.on_route(r)
        assert r.ids.tolist() == [[0, 1, 3], [0, 3, 1]]
        assert np.array_equal(r.weights[1], before[1])  # an unchanged token keeps its weights bit for bit
        sel = probs[0, [0, 1, 3]]
        want = sel / sel.sum() if rule is WeightRule.NORM else sel
        assert np.allclose(r.weights[0], want, rtol=1e-6)
        assert (pol.n_routed, pol.n_cpu, pol.n_replaced) == (6, 3, 1)  # 1, 2 of token 0; 1 of token 1


def test_degradation_skips_prompts_and_prompt_rows() -> None:
    probs = np.array([[0.40, 0.25, 0.20, 0.15]] * 3)
    ids = np.array([[0, 1, 2]] * 3)
    r = _route(ids.copy(), probs)
    GracefulDegradation(_Fixed({3}), ratio=0.5).on_route(r)  # decode_only: a 3-token ubatch is a prompt
    assert np.array_equal(r.ids, ids)
    GracefulDegradation(_Fixed({3}), ratio=0.5, decode_only=False, skip_rows=2).on_route(r)
    assert np.array_equal(r.ids[:2], ids[:2]) and r.ids[2].tolist() == [0, 1, 3]


def test_prompt_swap_residency_swaps_by_the_prompt_rows() -> None:
    res = PromptSwapResidency({0: np.array([5, 4, 0, 0])}, {0: 2}, n_expert=4, prompt_tokens=2)
    assert res.resident(0) == {0, 1}
    r = _route(np.array([[2, 3], [2, 3], [1, 0]]), np.full((3, 4), 0.25))
    res.on_route(r)  # prompt rows: 2 x2, 3 x2; 0, 1 unused -> both swap
    assert res.resident(0) == {2, 3}


# -- on the fixtures, CPU-buffer cache -------------------------------------------------------------
# blocking loads in the long suite (`make test-long`); the default suite runs the asynchronous ones
@pytest.mark.parametrize("blocking", [False, pytest.param(True, marks=pytest.mark.long)])
def test_daop_generates_as_stock_and_its_counters_equal_the_replay(fixture_model: Path, blocking: bool) -> None:
    cal = default_calibration_dir(fixture_model)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        ref = eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True).tokens
        n_expert = eng.info.n_expert
    recorder = StepRecorder()
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 4,
                                                    policy=DaopConfig(blocking=blocking, calibration=cal)))
        assert cache is not None and isinstance(eng.experts.policy, DaopPolicy)
        eng.set_policies([recorder])  # runs before the cache controller, sees the same ids
        got = eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True).tokens
        cache.sync()
        st = cache.stats()
        live = eng.experts.policy
        n_slots = dict(cache.n_slots)
    assert got == ref
    sim = replay_policy(make_policy("daop", n_slots, blocking=blocking, calibration=cal, n_expert=n_expert),
                   recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert live.n_prompts == 1 and live.n_swaps > 0 and sim.hits > 0
    assert sim.loads == sum(n_slots.values()) + live.n_swaps  # the placement, then one swap per prompt


@pytest.mark.parametrize("n_ubatch,threshold", [(64, 1.05), (16, 1.05), (16, 2.0)])
def test_native_daop_decides_as_the_python_policy(fixture_model: Path, n_ubatch: int, threshold: float) -> None:
    """Prompt swap: DAOP's swap inside llama.cpp (no routing callback) = DaopPolicy replayed on the routes of
    the same two generations (a prompt of one ubatch or several, then decode; the second prompt swaps again)."""
    from edgemoe.policies.daop import DaopPolicy as Daop
    from edgemoe.policies.residency import load_frequency

    cal = default_calibration_dir(fixture_model)
    config = dict(PLAIN, n_ubatch=n_ubatch)
    recorder = StepRecorder()
    prompts = (TEXT[:120], TEXT[40:170])
    with Engine(fixture_model, LoadConfig(**config)) as eng:
        eng.set_policies([recorder])
        ref = [eng.generate(p, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens for p in prompts]
        n_expert, layers = eng.info.n_expert, list(eng.info.moe_layers)
    with Engine(fixture_model, LoadConfig(**config)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 4,
                                                    policy=DaopConfig(calibration=cal, threshold=threshold)))
        assert cache is not None
        got = [eng.generate(p, max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens for p in prompts]
        cache.sync()
        st = cache.stats()
        n_slots = dict(cache.n_slots)
        assert eng.control_stats()["n_host_syncs"] == 0
    assert got == ref
    freq = load_frequency(cal, n_expert=n_expert, layers=layers, phase="decode")
    sim = replay_policy(Daop(freq, n_slots, n_expert, threshold=threshold), recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert sim.loads > sum(n_slots.values())  # the placement, then swaps


def test_native_daop_refuses_a_threshold_below_one(fixture_model: Path) -> None:
    from edgemoe.runtime import native

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        eng.enable_expert_cache(CacheConfig(2, policy=ManualConfig()))
        assert native.moe_cache_set_prompt_swap(eng.handle.ctx, 0.99) == -1
        assert native.moe_cache_set_prompt_swap(eng.handle.ctx, 1.0) == 0


def test_degradation_in_a_generation_changes_only_non_resident_picks(fixture_model: Path) -> None:
    cal = default_calibration_dir(fixture_model)
    before, after = StepRecorder(), StepRecorder()
    seen: list[tuple[int, set[int]]] = []

    class Snapshot:
        wants_probs = False
        wants_gate_inp = False

        def on_route(self, r: RouteRecord) -> None:
            seen.append((r.layer, eng.experts.policy.resident(r.layer)))

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        n_expert = eng.info.n_expert
        eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=DaopConfig(calibration=cal)))
        deg = GracefulDegradation(eng.experts.policy, ratio=0.5)
        eng.set_policies([before, Snapshot(), deg, after])
        eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True)
    a = [ids for step in before.steps for _, ids in step]
    b = [ids for step in after.steps for _, ids in step]
    assert len(a) == len(b) == len(seen)
    changed = 0
    for x, y, (_, res) in zip(a, b, seen, strict=False):
        diff = x != y
        if x.shape[0] > 1:
            assert not diff.any()  # prompts are left alone
        changed += int(diff.sum())
        assert all(int(e) not in res for e in x[diff]) and all(int(e) in res for e in y[diff])
    assert changed == deg.n_replaced > 0 and deg.n_cpu > deg.n_replaced


def test_cli_policy_daop(fixture_model: Path) -> None:
    import json

    from click.testing import CliRunner

    from edgemoe.cli.main import cli

    args = ["generate", str(fixture_model), "-p", "ROMEO: But soft, what light", "-n", "8", "--temp", "0", "--json"]
    plain = json.loads(CliRunner().invoke(cli, args, catch_exceptions=False).stdout)
    res = CliRunner().invoke(cli, [*args, "--expert-slots", "2", "--policy", "daop"], catch_exceptions=False)
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["cache"]["policy"] == "daop" and out["cache"]["hits"] > 0 and out["tokens"] == plain["tokens"]
    assert out["control"]["n_host_syncs"] == 0  # daop runs inside llama.cpp (prompt swap)
    res = CliRunner().invoke(cli, [*args, "--expert-slots", "2", "--policy", "daop", "--blocking-loads"],
                             catch_exceptions=False)
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["control"]["n_host_syncs"] > 0 and out["tokens"] == plain["tokens"]  # blocking: in the hook


def test_rule_weights_reproduce_the_layers_own_weights(fixture_model: Path) -> None:
    """The weights degradation gives a changed token are what llama.cpp gives a selection: checked on
    every route's unchanged selection."""
    checked = []

    class Check:
        wants_probs = True
        wants_gate_inp = False

        def on_route(self, r: RouteRecord) -> None:
            sel = np.take_along_axis(r.probs, r.ids, axis=1)
            w = rule_weights(sel, r.ids >= 0, r.weight_rule, r.weight_scale)
            checked.append(np.allclose(w, r.weights, rtol=1e-5, atol=1e-7))

    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        eng.set_policies([Check()])
        eng.generate(TEXT[:80], max_tokens=4, sampling=GREEDY, ignore_eog=True)
    assert checked and all(checked)


def test_cli_perplexity_degrade(fixture_model: Path, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from edgemoe.cli.main import cli

    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    args = ["perplexity", str(fixture_model), "--input", str(text), "--ctx", "96", "--json", "--prompt-tokens", "32"]
    base = json.loads(CliRunner().invoke(cli, args, catch_exceptions=False).stdout)
    res = CliRunner().invoke(cli, [*args, "--degrade", "0.3", "--expert-slots", "2"], catch_exceptions=False)
    deg = json.loads(res.stdout)
    assert deg["tokens"] == base["tokens"] and deg["prompt_tokens"] == 32
    assert deg["degrade"]["replaced"] > 0 and 0 < deg["degrade"]["cpu_avoided"] < 1
    assert deg["nll"] != base["nll"]
    bad = CliRunner().invoke(cli, [*args, "--degrade", "0.3"])
    assert bad.exit_code != 0 and "--expert-slots" in bad.output
