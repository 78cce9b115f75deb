"""DP cache allocation (edgemoe.policies.allocation) and the DALI replacement policy, on numpy traces.

The replays are checked against `simulate` (the policy objects the engine runs), the DP against
brute force; the last test records a trace of each fixture model and checks that DP allocation,
replayed, misses no more than equal allocation with the same slots.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from edgemoe.policies.allocation import (
    AllocationError,
    decode_steps,
    dp_allocate,
    equal_allocate,
    f_curves,
    keep_top1,
    layer_steps,
    replay_curve,
    steps_of,
    total_cost,
)
from edgemoe.policies.daop import DaopPolicy
from edgemoe.policies.residency import DaliPolicy, Load, dali_default_update, make_policy, replay_policy


def _random_steps(rng: np.random.Generator, n_expert: int, k: int, n: int = 80) -> list[np.ndarray]:
    """Decode steps with a few prefill-like ubatches, skewed ids and some dropped slots (-1)."""
    steps = []
    for _ in range(n):
        tokens = int(rng.choice([1, 1, 1, 4, 11]))
        ids = rng.zipf(1.4, (tokens, k)) % n_expert
        if rng.random() < 0.3:
            ids[rng.random(ids.shape) < 0.3] = -1
        steps.append(ids)
    return steps


@pytest.mark.parametrize("kind", ["lru", "dali", "static", "daop"])
def test_fast_replays_equal_simulate(kind: str) -> None:
    rng = np.random.default_rng(3)
    for _ in range(12):
        E, k = int(rng.choice([4, 8, 12])), int(rng.integers(1, 4))
        steps = _random_steps(rng, E, k)
        kw = dict(n_expert=E, frequency=rng.random(E), window=int(rng.integers(1, 6)),
                  update=int(rng.integers(1, 4)))
        counted = rng.random(len(steps)) < 0.7 if rng.random() < 0.5 else None
        fast = replay_curve(steps, kind, E, counted=counted, **kw)
        slow = replay_curve(steps, kind, E, counted=counted, fast=False, **kw)
        assert np.array_equal(fast.misses, slow.misses) and np.array_equal(fast.loads, slow.loads)
        for t in (1, E // 2, E):  # one column, as the whole policy replays it
            pol = make_policy(kind, {0: t}, n_expert=E, window=kw["window"], update=kw["update"]) \
                if kind not in ("static", "daop") else DaopPolicy({0: kw["frequency"]}, {0: t}, E) \
                if kind == "daop" else None
            if pol is not None:
                res = replay_policy(pol, ([(0, s)] for s in steps), counted)
                assert (res.misses, res.loads) == (fast.misses[t], fast.loads[t])
        on = [True] * len(steps) if counted is None else counted
        assert fast.misses[0] == fast.routed == sum(int((s >= 0).sum()) for s, c in zip(steps, on, strict=False) if c)
        if kind == "static":  # nested top-t sets
            assert np.all(np.diff(fast.misses) <= 0)


def test_layer_steps_cut_the_trace_as_the_engine_ran_it() -> None:
    ids = np.arange(10 * 2 * 1).reshape(10, 2, 1)
    phase = np.array([0, 0, 0, 0, 0, 1, 1, 0, 0, 1])
    seq = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    steps = layer_steps(ids, [3, 5], phase, seq, ubatch=3)
    # a prefill of 5 in ubatches of 3, decode tokens alone
    assert [len(s) for s in steps[3]] == [3, 2, 1, 1, 2, 1]
    assert np.array_equal(steps[5][1][:, 0], ids[3:5, 1, 0])
    assert [[il for il, _ in st] for st in steps_of(steps)] == [[3, 5]] * 6
    assert decode_steps(phase, seq, ubatch=3).tolist() == [False, False, True, True, False, True]
    with pytest.raises(Exception, match="expected"):
        layer_steps(ids, [3], phase, seq, ubatch=3)


def test_alpha_keeps_the_first_expert_and_beta_scales() -> None:
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 8, (1, 2)) for _ in range(400)]
    kept = keep_top1(steps, 0.25, seed=1)
    one = np.mean([s[0, 1] == -1 for s in kept])
    assert 0.18 < one < 0.32 and all(a[0, 0] == b[0, 0] for a, b in zip(steps, kept, strict=False))
    base = f_curves({0: steps}, "lru", 8, n_expert=8)[0]
    assert base[0] == 2.0  # at t = 0 every routed expert of a token misses
    half = f_curves({0: steps}, "lru", 8, n_expert=8, beta={0: 0.5})[0]
    assert np.allclose(half, base / 2)
    fewer = f_curves({0: steps}, "lru", 8, n_expert=8, alpha={0: 0.5})[0]
    assert fewer[0] < base[0] and fewer[4] < base[4]


def _brute_force(curves: dict[int, np.ndarray], budget: int, w: dict[int, int]) -> float:
    layers = sorted(curves)
    best = np.inf
    for ts in itertools.product(*[range(len(curves[il])) for il in layers]):
        if sum(t * w[il] for t, il in zip(ts, layers, strict=False)) <= budget:
            best = min(best, sum(curves[il][t] for t, il in zip(ts, layers, strict=False)))
    return best


def test_dp_is_optimal_and_within_the_budget() -> None:
    rng = np.random.default_rng(7)
    for trial in range(60):
        n_layers, E = int(rng.integers(3, 5)), int(rng.integers(2, 6))
        curves = {il: np.sort(rng.random(E + 1))[::-1] * rng.uniform(0.5, 4) if trial % 2
                  else rng.random(E + 1) for il in range(0, 2 * n_layers, 2)}  # decreasing, or any shape
        if trial % 3 == 0:  # bytes per expert
            w = {il: int(rng.integers(1, 5)) * 96 for il in curves}
            budget = int(rng.integers(0, sum(w.values()) * E + 1))
            got = dp_allocate(curves, budget, bytes_per_expert=w)
        else:
            w = {il: 1 for il in curves}
            budget = int(rng.integers(0, n_layers * E + 1))
            got = dp_allocate(curves, budget)
        assert set(got) == set(curves) and all(0 <= t < len(curves[il]) for il, t in got.items())
        assert sum(t * w[il] for il, t in got.items()) <= budget
        assert total_cost(curves, got) == pytest.approx(_brute_force(curves, budget, w), abs=1e-9)


def test_dp_with_identical_curves_is_equal_allocation() -> None:
    convex = 4.0 / (1.0 + np.arange(9)) ** 1.5  # strictly decreasing and convex: equal is the one optimum
    flat_tail = np.array([8.0, 5.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # ties past t = 5
    for curve in (convex, flat_tail):
        curves = {il: curve for il in range(6)}
        for per_layer in range(9):
            assert dp_allocate(curves, 6 * per_layer) == equal_allocate(range(6), 6 * per_layer, max_slots=8)
    w = {il: 1000 for il in range(4)}
    assert dp_allocate({il: convex for il in range(4)}, 4 * 3 * 1000 + 999, bytes_per_expert=w) == \
        {il: 3 for il in range(4)}


def test_dp_cost_is_monotone_in_the_budget_and_uses_it() -> None:
    rng = np.random.default_rng(11)
    curves = {il: np.sort(rng.random(17))[::-1] for il in range(5)}
    costs = []
    for budget in range(0, 5 * 16 + 1):
        got = dp_allocate(curves, budget)
        assert sum(got.values()) == budget  # strictly decreasing curves: every slot is worth having
        costs.append(total_cost(curves, got))
    assert all(b <= a + 1e-12 for a, b in zip(costs, costs[1:], strict=False))
    assert dp_allocate(curves, 10_000) == {il: 16 for il in range(5)}


def test_dp_min_slots_and_errors() -> None:
    curves = {0: np.array([1.0, 0.0, 0.0]), 1: np.array([5.0, 0.0, 0.0])}
    assert dp_allocate(curves, 1) == {0: 0, 1: 1}
    assert dp_allocate(curves, 2, min_slots=1) == {0: 1, 1: 1}
    with pytest.raises(AllocationError, match="does not fit"):
        dp_allocate(curves, 1, min_slots=1)
    with pytest.raises(AllocationError, match="bytes per expert"):
        dp_allocate(curves, 100, bytes_per_expert={0: 10})
    assert equal_allocate([4, 2, 9], 7, max_slots=8) == {2: 3, 4: 2, 9: 2}


def test_dp_with_coarsened_byte_units_stays_within_the_budget() -> None:
    """Byte weights with a small gcd are rounded up to a coarser unit; the bytes left are topped up."""
    rng = np.random.default_rng(5)
    curves = {il: np.sort(rng.random(129))[::-1] for il in range(48)}
    w = {il: 884_736 * 3 + (405_504 if il % 3 == 0 else 0) for il in curves}  # Q4_K / Q6_K ffn_down mix
    budget = 12 * 2**30
    got = dp_allocate(curves, budget, bytes_per_expert=w)
    used = sum(t * w[il] for il, t in got.items())
    assert used <= budget and budget - used < max(w.values())


def test_dp_with_bytes_never_adds_to_the_slots_asked() -> None:
    """With smaller experts in some layers, the byte optimum alone holds more slots than asked."""
    rng = np.random.default_rng(3)
    w = {il: 35_840 if il % 3 == 0 else 29_696 for il in range(8)}  # the qwen3moe fixture's Q6_K / Q4_K layers
    more = 0
    for _ in range(40):
        curves = {il: np.sort(rng.random(33))[::-1] * rng.uniform(0.5, 3) for il in w}
        per = int(rng.integers(1, 20))
        budget = per * sum(w.values())
        more += sum(dp_allocate(curves, budget, bytes_per_expert=w).values()) > 8 * per  # what went wrong
        got = dp_allocate(curves, budget, bytes_per_expert=w, max_total=8 * per)
        assert sum(got.values()) <= 8 * per and sum(t * w[il] for il, t in got.items()) <= budget
    assert more > 10
    # the slot optimum is taken when it fits the bytes: then it is exact
    curves = {il: np.sort(rng.random(33))[::-1] for il in w}
    by_slots = dp_allocate(curves, 64)
    assert dp_allocate(curves, 10**9, bytes_per_expert=w, max_total=64) == by_slots


def test_dali_policy_on_hand_made_routes() -> None:
    pol = DaliPolicy({0: 2}, n_expert=6, window=2, update=1)
    assert pol.on_route(0, np.array([[1, 2]])) == [Load(0, 1, 0), Load(0, 2, 1)]  # free slots fill
    assert pol.on_route(0, np.array([[3, 1]])) == []  # window: 3 (1 token) is no better than 2 (1 token)
    assert pol.on_route(0, np.array([[3, 4]])) == []  # mid-window
    # 3 (2 tokens) replaces 1 (0 tokens; ties with 2: the lower id)
    assert pol.on_route(0, np.array([[3, 5]])) == [Load(0, 3, 0)]
    assert pol.resident(0) == {2, 3}
    # a prefill ubatch with more misses than slots fills by routed tokens; one window of 3 tokens
    pol = DaliPolicy({0: 2}, n_expert=6, window=8, update=2)
    assert pol.on_route(0, np.array([[4, 1], [1, 5], [5, 1]])) == [Load(0, 1, 0), Load(0, 5, 1)]
    assert pol.on_route(7, np.array([[1, 2]])) == []  # a layer without slots
    assert dali_default_update(8) == 1 and dali_default_update(60) == 8 and dali_default_update(64) == 8
    with pytest.raises(Exception, match="window"):
        DaliPolicy({0: 2}, n_expert=6, window=0)


# -- on recorded traces of the fixture models ---------------------------------------------------
def _recorded_steps(path: Path, n_tokens: int = 768) -> tuple[dict[int, list[np.ndarray]], int]:
    from edgemoe.analysis.trace import record_trace
    from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
    from edgemoe.runtime.engine import Engine, LoadConfig

    text = split_corpus(default_corpus_dir() / "tinyshakespeare.txt").train_text()[:20000]
    with Engine(path, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64)) as eng:
        tr = record_trace(eng, eng.tokenize(text)[:n_tokens], ctx=256, mode="decode", prefill_tokens=64)
        return layer_steps(tr.ids, list(tr.layers), tr.phase, tr.seq, ubatch=eng.n_batch), eng.info.n_expert


@pytest.mark.long  # records a trace per policy: the long suite (`make test-long`)
@pytest.mark.parametrize("kind", ["lru", "dali"])
def test_dp_misses_no_more_than_equal_on_a_recorded_trace(fixture_model: Path, kind: str) -> None:
    by_layer, E = _recorded_steps(fixture_model)
    curves = f_curves(by_layer, kind, E, n_expert=E)
    steps = steps_of(by_layer)
    routed = {il: sum(int((s >= 0).sum()) for s in st) for il, st in by_layer.items()}

    def replayed_misses(slots: dict[int, int]) -> int:
        """The whole policy replayed; a layer without slots computes every routed expert on the CPU."""
        sim = replay_policy(make_policy(kind, slots, n_expert=E), steps)
        return sim.misses + sum(routed[il] for il, t in slots.items() if t == 0)

    for per_layer in (E // 4, E // 2):
        total = per_layer * len(by_layer)
        dp = dp_allocate(curves, total)
        eq = equal_allocate(list(by_layer), total, max_slots=E)
        assert sum(dp.values()) <= total and eq == {il: per_layer for il in by_layer}
        assert replayed_misses(dp) <= replayed_misses(eq), (per_layer, dp)
        # the curves are the replay's counters, layer by layer
        tokens = sum(s.shape[0] for s in by_layer[min(by_layer)])
        assert replayed_misses(dp) == round(total_cost(curves, dp) * tokens)


# -- allocate_slots: --alloc from a calibration -------------------------------------------------
def test_allocate_slots_dp_equal_fallbacks_and_cached_curves(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemoe.calibration.card import CalibrationError
    from edgemoe.calibration.slot_alloc import ROUTING_TRACE, allocate_slots
    from edgemoe.gguf.info import read_model_info

    from helpers.models import FIXTURE_MODELS, ROOT

    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "cache"))
    qwen = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
    mixtral = next(p for p in FIXTURE_MODELS if "mixtral" in p.name)
    info = read_model_info(qwen)
    cal = ROOT / "calibrations" / qwen.name.removesuffix(".gguf")
    n = len(info.moe_layers)

    dp = allocate_slots(info, alloc=None, policy="lru", calibration=cal, slots_per_layer=8)
    assert dp.alloc == "dp" and dp.note is None and sum(dp.slots.values()) == 8 * n
    cached = list((tmp_path / "cache" / "allocation").glob("curves-*.npz"))
    assert len(cached) == 1
    assert allocate_slots(info, alloc="dp", policy="lru", calibration=cal, slots_per_layer=8) == dp
    cached[0].write_bytes(b"not an npz")  # a damaged cache entry is replayed again
    assert allocate_slots(info, alloc="dp", policy="lru", calibration=cal, slots_per_layer=8) == dp

    by_bytes = allocate_slots(info, alloc="dp", policy="lru", calibration=cal, slots_per_layer=8,
                               budget_bytes=8 * sum(info.bytes_per_expert_by_layer.values()))
    assert sum(t * info.bytes_per_expert_by_layer[il] for il, t in by_bytes.slots.items()) <= \
        8 * sum(info.bytes_per_expert_by_layer.values())
    # --expert-slots 8 --alloc dp handed out 66 slots (its Q4_K layers' slots are cheaper): never more than 8 x n
    assert len(set(info.bytes_per_expert_by_layer.values())) > 1 and by_bytes.alloc == "dp"
    assert sum(by_bytes.slots.values()) <= 8 * n

    equal = {il: 8 for il in info.moe_layers}
    assert allocate_slots(info, alloc="equal", policy="lru", calibration=cal, slots_per_layer=8).slots == equal
    quiet = allocate_slots(info, alloc=None, policy="lru", calibration=None, slots_per_layer=8)
    assert (quiet.alloc, quiet.note, quiet.slots) == ("equal", None, equal)
    asked = allocate_slots(info, alloc="dp", policy="lru", calibration=None, slots_per_layer=8)
    assert asked.alloc == "equal" and "needs a calibration" in (asked.note or "")
    manual = allocate_slots(info, alloc="dp", policy="manual", calibration=cal, slots_per_layer=8)
    assert manual.alloc == "equal" and "manual" in (manual.note or "")
    bare = tmp_path / "bare"
    bare.mkdir()
    no_trace = allocate_slots(info, alloc=None, policy="lru", calibration=bare, slots_per_layer=8)
    assert no_trace.alloc == "equal" and ROUTING_TRACE in (no_trace.note or "")
    other = ROOT / "calibrations" / mixtral.name.removesuffix(".gguf")
    with pytest.raises(CalibrationError, match="another model"):
        allocate_slots(info, alloc=None, policy="lru", calibration=other, slots_per_layer=8)
    with pytest.raises(CalibrationError, match="unknown `alloc="):
        allocate_slots(info, alloc="greedy", policy="lru", calibration=cal, slots_per_layer=8)
