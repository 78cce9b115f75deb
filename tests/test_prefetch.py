"""ProMoE's prefetcher (edgemoe.policies.promoe) and the timed replay (edgemoe.policies.replay) on hand-made
routes: no model, no native library.

The predictor is gate reuse with identity routers, so a route's "router input" is the score vector of
the layer d ahead: each test says exactly what is predicted.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgemoe.errors import EdgeMoeError
from edgemoe.policies.copy_queue import (
    CacheModel,
    CancelOp,
    CopyStream,
    CopyTiming,
    IssueOp,
    LoadState,
    PrefetchOp,
    Priority,
)
from edgemoe.policies.promoe import Prediction, PrefetchError, PromoePolicy, predicted_experts
from edgemoe.policies.replay import replay
from edgemoe.policies.residency import Load, StaticPolicy, make_policy, replay_policy
from edgemoe.predictors import GatePredictor, ModelSpec, PrevTokenPredictor

E, K = 8, 2
LAYERS = (0, 1, 2, 3)


def oracle(distance: int = 2) -> GatePredictor:
    spec = ModelSpec(layers=LAYERS, n_expert=E, k=K, n_embd=E, routers={j: np.eye(E, dtype=np.float32)
                                                                         for j in range(len(LAYERS))})
    return GatePredictor(spec, distance)


def scores(*best: int) -> np.ndarray:
    """One token's router input whose scores rank `best` first, in that order."""
    h = np.zeros((1, E), np.float32)
    for i, e in enumerate(best):
        h[0, e] = 10.0 - i
    return h


def ids(*experts: int) -> np.ndarray:
    return np.array([experts], np.int32)


def policy(slots: int = 4, **kw: object) -> PromoePolicy:
    return PromoePolicy({il: slots for il in LAYERS}, LAYERS, oracle(kw.pop("distance", 2)), **kw)  # type: ignore[arg-type]


# -- the cache model (the asynchronous loads' rules) ----------------------------------------------------------------
def test_cache_model_follows_the_native_queue() -> None:
    m = CacheModel({0: 2}, {0: (10, 20, 30)})
    assert m.prefetch(Load(0, 5, 0), Priority.SPECULATIVE) and m.state(0, 5) is LoadState.QUEUED
    assert not m.prefetch(Load(0, 5, 1), Priority.PRECISE)  # queued already: nothing changes
    m.prefetch(Load(0, 6, 1), Priority.PRECISE)
    assert m.issue(1) == 1 and m.state(0, 6) is LoadState.COPYING  # the precise load goes first
    assert m.issue() == 5 and m.state(0, 5) is LoadState.RESIDENT and m.state(0, 6) is LoadState.RESIDENT
    m.prefetch(Load(0, 7, 0), Priority.SPECULATIVE)  # evicts 5 at once
    assert m.state(0, 5) is LoadState.ABSENT and m.occupant(0, 0)[0] == 7
    m.prefetch(Load(0, 4, 0), Priority.SPECULATIVE)  # supersedes the queued load of 7
    m.cancel(0, 0)
    assert m.occupant(0, 0) == (-1, None) and m.state(0, 6) is LoadState.RESIDENT
    queued, completed, dropped, nbytes = m.take_events()
    assert [r.expert for r in queued] == [5, 6, 7, 4] and [r.expert for r in completed] == [6, 5]
    assert [r.expert for r in dropped] == [7, 4] and nbytes == 120
    assert m.take_ops() == [PrefetchOp(Load(0, 5, 0), 0), PrefetchOp(Load(0, 6, 1), 1), IssueOp(1), IssueOp(5),
                            PrefetchOp(Load(0, 7, 0), 0), PrefetchOp(Load(0, 4, 0), 0), CancelOp(0, 0)]


def test_copy_stream_moves_what_fits_each_interval() -> None:
    m = CacheModel({0: 4}, {0: (100, 100, 100)})
    s = CopyStream(CopyTiming(bandwidth=250.0, layer_s=1.0))  # 250 bytes per layer: two and a half chunks
    for e in range(2):
        m.prefetch(Load(0, e, e), Priority.SPECULATIVE)
    assert s.interval(m, 1) == 2 and s.budget == 50  # half a chunk carries over
    assert s.interval(m, 1) == 3 and s.budget == 0  # 300 bytes: the rest of expert 0, most of expert 1
    assert m.state(0, 0) is LoadState.RESIDENT and m.state(0, 1) is LoadState.COPYING
    assert s.interval(m, 1) == 1 and s.budget == 0  # the queue ran dry: an idle stream saves nothing
    m.prefetch(Load(0, 2, 2), Priority.PRECISE)
    assert s.wait(m, m.pending(0)) == pytest.approx(300 / 250) and m.state(0, 2) is LoadState.RESIDENT
    with pytest.raises(EdgeMoeError, match="must both be > 0"):
        CopyTiming(bandwidth=0.0)


# -- the policy ----------------------------------------------------------------------------------------
def test_predicted_experts_one_token_and_a_ubatch() -> None:
    s = np.array([[0.0, 5, 1, 7, 3, 0, 0, 0]])
    assert predicted_experts(s, 3, 3) == [3, 1, 4]
    assert predicted_experts(s, 3, 2) == [3, 1]
    ub = np.array([[9.0, 8, 0, 0, 0, 0, 0, 0], [0, 9, 8, 0, 0, 0, 0, 0], [0, 8, 0, 0, 0, 0, 0, 9]])
    assert predicted_experts(ub, 2, 8) == [1, 0, 7, 2]  # 1 in three top-2s; then best rank; then the lower id


def test_promoe_queues_top_k_plus_m_of_layer_l_plus_d_in_score_order() -> None:
    pol, m = policy(extra=1), CacheModel({il: 4 for il in LAYERS})
    pol.on_route(0, ids(0, 1), scores(5, 3, 6, 7), m)
    reqs = m.pending(2)
    assert [(r.expert, r.priority) for r in reqs] == [(5, 0), (3, 0), (6, 0)]  # k + m = 3, best first
    assert all(isinstance(r.tag, Prediction) and r.tag.experts == (5, 3, 6) for r in reqs)
    assert m.pending(1) == [] and pol.take_prediction(2) is not None and pol.take_prediction(2) is None
    pol.on_route(3, ids(0, 1), scores(1, 2), m)  # layer 3 + 2 is past the last MoE layer: no prediction
    assert all(pol.take_prediction(il) is None for il in LAYERS)


def test_early_preemption_drops_unneeded_and_promotes_needed_loads() -> None:
    pol, m = policy(extra=2), CacheModel({il: 4 for il in LAYERS})
    pol.on_route(0, ids(0, 1), scores(5, 3, 6, 7), m)  # queues 5, 3, 6, 7 for layer 2; nothing issued
    m.take_ops()
    pol.on_route(2, ids(3, 4), None, m)  # routes 3 (queued) and 4 (absent: runs on the CPU, refilled)
    assert m.state(2, 5) is m.state(2, 6) is m.state(2, 7) is LoadState.ABSENT  # dropped
    prio = {r.expert: r.priority for r in m.pending(2)}
    assert prio == {3: Priority.PRECISE, 4: Priority.REFILL}
    ops = m.take_ops()
    assert ops[:3] == [CancelOp(2, 0), CancelOp(2, 2), CancelOp(2, 3)]  # 5, 6, 7's slots
    assert ops[3:5] == [CancelOp(2, 1), PrefetchOp(Load(2, 3, 1), Priority.PRECISE)]  # 3 raised: queued again
    _, _, dropped, _ = m.take_events()
    assert sum(isinstance(r.tag, Prediction) for r in dropped) == 3  # the promotion is no preemption


def test_admission_queues_only_what_can_arrive_in_time() -> None:
    # 3 chunks of 1 byte per expert; 2 bytes per layer time: in d = 2 layer times 4 bytes, one expert
    timing = CopyTiming(bandwidth=2.0, layer_s=1.0)
    pol, m = policy(extra=2, timing=timing), CacheModel({il: 4 for il in LAYERS})
    pol.on_route(0, ids(0, 1), scores(5, 3, 6, 7), m)  # layer 0's misses: refills within one layer time
    assert [r.expert for r in m.pending(0)] == [] and [r.expert for r in m.pending(2)] == [5]
    m.issue()
    pol.on_route(1, ids(0, 1), scores(5, 3, 6, 7), m)  # a refill (3 bytes) never fits one layer time (2)
    assert m.pending(1) == [] and [r.expert for r in m.pending(3)] == [5]
    wide = policy(extra=2, timing=CopyTiming(bandwidth=6.0, layer_s=1.0))
    m2 = CacheModel({il: 4 for il in LAYERS})
    wide.on_route(0, ids(0, 1), scores(5, 3, 6, 7), m2)  # 12 bytes in two layer times: four experts
    assert [r.expert for r in m2.pending(2)] == [5, 3, 6, 7] and [r.expert for r in m2.pending(0)] == [0, 1]
    assert policy(timing=CopyTiming()).timing is None  # an infinite bandwidth admits everything


def test_loads_never_evict_the_routed_experts_and_follow_lru() -> None:
    pol, m = policy(slots=3, distance=1), CacheModel({il: 3 for il in LAYERS})
    for step in ([0, 1], [2, 0], [3, 4]):  # layer 1, 3 slots
        pol.on_route(1, ids(*step), None, m)
        m.issue()
    assert set(m.resident(1)) == {2, 3, 4}  # [3, 4] evicted the least recently used: 1, then 0
    pol.on_route(1, ids(0, 3), None, m)  # 0 takes 2's slot (3 is routed: pinned)
    # every slot holds a routed expert or is loading one: 5 finds no victim and runs on the CPU only
    pol.on_route(1, np.array([[0, 3], [4, 5]], np.int32), None, m)
    assert m.state(1, 0) is LoadState.QUEUED and m.state(1, 5) is LoadState.ABSENT and set(m.resident(1)) == {3, 4}
    m.issue()
    # a speculative load never evicts an expert predicted with it: 7 takes 4's slot
    pol.on_route(0, ids(0, 1), scores(0, 3, 7), m)
    assert m.request(1, 7) is not None and set(m.resident(1)) == {0, 3}


def test_blocking_waits_for_the_routed_experts() -> None:
    pol = policy(slots=4, blocking=True)
    steps = [[(0, ids(0, 1), scores(2, 3, 4)), (1, ids(0, 1), None), (2, ids(5, 6), None), (3, ids(0, 1), None)]]
    r = replay(pol, steps * 3, timing=CopyTiming(bandwidth=3.0, layer_s=1.0))
    assert r.misses == 0 and r.stall_s > 0  # every routed expert was copied before its layer ran
    r2 = replay(policy(slots=4, blocking=True), steps * 3)
    assert r2.misses == 0 and r2.stall_s == 0.0 and r2.hits == r.hits


def test_goodpred_is_accuracy_times_fetch_rate() -> None:
    # layer 2 is predicted from layer 0's input: (5, 3, 6) with k + m = 3; it then routes 3 and 4
    step = [(0, ids(0, 1), scores(5, 3, 6)), (1, ids(0, 1), None), (2, ids(3, 4), None), (3, ids(0, 1), None)]
    fast = replay(policy(extra=1), [step]).prefetch
    assert fast is not None and (fast.issued, fast.useful, fast.preempted) == (3, 1, 0)
    assert (fast.accuracy, fast.fetch_rate, fast.goodpred) == (0.5, 1.0, 0.5)
    # 3 chunks of 1 byte per expert, 1 byte per layer: by layer 2's routing (2 intervals) nothing is complete
    slow = replay(policy(extra=1), [step], timing=CopyTiming(bandwidth=1.0, layer_s=1.0)).prefetch
    assert slow is not None and (slow.issued, slow.useful, slow.preempted) == (3, 0, 2)  # 3 is promoted
    assert (slow.accuracy, slow.fetch_rate, slow.goodpred) == (0.5, 0.0, 0.0)


def test_promoe_refuses_what_it_cannot_use() -> None:
    spec = oracle().spec
    with pytest.raises(PrefetchError, match="does not predict from the router input"):
        PromoePolicy({0: 2}, LAYERS, PrevTokenPredictor(spec, 2))
    with pytest.raises(PrefetchError, match="use >= 0"):
        policy(extra=-1)
    with pytest.raises(PrefetchError, match="MoE layers"):
        PromoePolicy({0: 2}, (0, 1), oracle())
    with pytest.raises(EdgeMoeError, match="needs an expert predictor"):
        make_policy("promoe", {0: 2})


# -- replay vs simulate --------------------------------------------------------------------------------
def _routes(seed: int, n_steps: int = 240) -> tuple[list[list[tuple[int, np.ndarray]]], list[bool]]:
    rng = np.random.default_rng(seed)
    steps, counted = [], []
    for s in range(n_steps):
        prefill = s % 60 == 0
        n = 24 if prefill else 1
        skewed = rng.choice(E, size=(n, len(LAYERS), K), p=np.linspace(2, 1, E) / np.linspace(2, 1, E).sum())
        steps.append([(il, np.sort(skewed[:, j], axis=1).astype(np.int32)) for j, il in enumerate(LAYERS)])
        counted.append(not prefill)
    return steps, counted


@pytest.mark.parametrize("kind", ["lru", "static", "dali"])
@pytest.mark.parametrize("blocking", [False, True])
def test_replay_at_infinite_bandwidth_counts_as_simulate(kind: str, blocking: bool) -> None:
    freq = {il: np.arange(E, 0, -1, dtype=float) for il in LAYERS}
    for seed, slots in ((0, {il: 3 for il in LAYERS}), (1, {0: 0, 1: 1, 2: 4, 3: E})):
        steps, counted = _routes(seed)

        def make(slots: dict[int, int] = slots) -> object:  # this iteration's slots
            return (StaticPolicy(freq, slots) if kind == "static"
                    else make_policy(kind, slots, blocking=blocking, n_expert=E))

        sim = replay_policy(make(), steps, counted)  # type: ignore[arg-type]
        got = replay(make(), steps, counted=counted)  # type: ignore[arg-type]
        assert (got.hits, got.misses, got.loads) == (sim.hits, sim.misses, sim.loads), (kind, blocking, slots)
        assert got.hits > 0 and got.tokens == sum(counted) and got.stall_s == 0.0


def test_a_slower_link_costs_lru_hits_and_counts_bytes() -> None:
    steps, counted = _routes(2)
    slots = {il: 4 for il in LAYERS}
    chunks = {il: (100, 100, 200) for il in LAYERS}
    fast = replay(make_policy("lru", slots), steps, counted=counted, chunk_bytes=chunks)
    slow = replay(make_policy("lru", slots), steps, counted=counted, chunk_bytes=chunks,
                  timing=CopyTiming(bandwidth=150.0, layer_s=1.0))
    assert slow.hit_rate < fast.hit_rate and slow.loads < fast.loads
    assert fast.bytes == 400 * fast.loads and fast.bytes_per_token == pytest.approx(fast.bytes / fast.tokens)
    assert 0.0 < fast.useful_share <= 1.0 and fast.prefetch is None  # type: ignore[operator]
