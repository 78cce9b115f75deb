"""DALI with its residual-based prefetcher (edgemoe.policies.dali_prefetch) on hand-made routes: no model,
no native library. The predictor is gate reuse with identity routers (tests/test_prefetch.py's oracle), so a
route's "router input" is the score vector of the next layer.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgemoe.policies.copy_queue import CacheModel, LoadState, Priority
from edgemoe.policies.dali_prefetch import DaliPrefetchPolicy, dali_default_prefetch
from edgemoe.policies.promoe import Prediction, PrefetchError
from edgemoe.policies.replay import replay
from edgemoe.policies.residency import DaliPolicy, replay_policy
from edgemoe.predictors import GatePredictor, ModelSpec

E, K = 8, 2
LAYERS = (0, 1, 2, 3)


def oracle() -> GatePredictor:
    spec = ModelSpec(layers=LAYERS, n_expert=E, k=K, n_embd=E, routers={j: np.eye(E, dtype=np.float32)
                                                                         for j in range(len(LAYERS))})
    return GatePredictor(spec, 1)


def scores(*rows: tuple[int, ...]) -> np.ndarray:
    """Router inputs, one row per token, whose scores rank each row's experts first, in that order."""
    h = np.zeros((len(rows), E), np.float32)
    for t, best in enumerate(rows):
        for i, e in enumerate(best):
            h[t, e] = 10.0 - i
    return h


def ids(*rows: tuple[int, ...]) -> np.ndarray:
    return np.array(rows, np.int32)


def dali(slots: int = 4, size: int = 1, window: int = 4, update: int = 1) -> DaliPrefetchPolicy:
    return DaliPrefetchPolicy({il: slots for il in LAYERS}, LAYERS, oracle(), E, size=size, window=window,
                              update=update)


def _routes(seed: int, n_steps: int = 160) -> tuple[list, list[bool]]:
    """Skewed random routes: a 24-token prefill every 40 steps, else single decode tokens (not counted)."""
    rng = np.random.default_rng(seed)
    p = np.linspace(3, 1, E) / np.linspace(3, 1, E).sum()
    steps, counted = [], []
    for s in range(n_steps):
        n = 24 if s % 40 == 0 else 1
        steps.append([(il, np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(n)]).astype(np.int32))
                      for il in LAYERS])
        counted.append(n == 1)
    return steps, counted


@pytest.mark.parametrize("window,update", [(4, 1), (1, 2), (8, 3)])
def test_without_router_inputs_it_replaces_as_dali(window: int, update: int) -> None:
    """With nothing to predict from, it is DaliPolicy: the same hits and misses at infinite bandwidth."""
    for seed, slots in ((0, 3), (1, 5)):
        steps, counted = _routes(seed)
        n_slots = {il: slots for il in LAYERS}
        sim = replay_policy(DaliPolicy(n_slots, E, window=window, update=update), steps, counted)
        got = replay(dali(slots, window=window, update=update), steps, counted=counted)
        assert (got.hits, got.misses) == (sim.hits, sim.misses) and sim.hits > 0 and sim.misses > 0
        # every step counted: the same loads, less the last step's swaps (queued at a next route that never
        # comes) and a warm-up load a swap drops before it finishes
        every = replay(dali(slots, window=window, update=update), steps)
        sim_every = replay_policy(DaliPolicy(n_slots, E, window=window, update=update), steps)
        assert sim_every.loads - update * len(LAYERS) <= every.loads <= sim_every.loads


def _warm(pol: DaliPrefetchPolicy, m: CacheModel, layer: int, *route: tuple[int, ...]) -> None:
    """Route `route` at `layer` (no prediction) and let the copies finish."""
    pol.on_route(layer, ids(*route), None, m)
    m.issue()
    m.sync()


def test_prefetches_the_best_of_the_next_layer_into_the_lowest_score_slot() -> None:
    pol, m = dali(slots=2, size=1), CacheModel({il: 2 for il in LAYERS})
    _warm(pol, m, 1, (0, 1))  # warm-up: layer 1 holds experts 0 and 1 (slots 0, 1), one token each
    _warm(pol, m, 1, (1, 3))  # expert 1 now scores 2, expert 0 scores 1 (3 misses, the slots are full)
    assert {e: r.slot for e, r in m.resident(1).items()} == {0: 0, 1: 1}
    pol.on_route(0, ids((2, 4)), scores((5, 6)), m)  # layer 0 predicts layer 1: top-k (5, 6), prefetch size 1
    (req,) = m.pending(1)
    assert (req.expert, req.slot, req.priority) == (5, 0, Priority.SPECULATIVE)  # into expert 0's slot
    assert isinstance(req.tag, Prediction) and req.tag.experts == (5,)
    assert m.state(1, 0) is LoadState.ABSENT and m.state(1, 1) is LoadState.RESIDENT


def test_a_ubatch_prefetches_the_experts_most_tokens_are_predicted_to_use() -> None:
    pol, m = dali(slots=4, size=2), CacheModel({il: 4 for il in LAYERS})
    pol.on_route(0, ids((0, 1), (0, 1), (0, 1)), scores((5, 6), (7, 5), (6, 5)), m)
    assert [r.expert for r in m.pending(1)] == [5, 6]  # 5 in three tokens' top-2, 6 in two, 7 in one
    pol.on_route(3, ids((0, 1)), scores((5, 6)), m)  # the last MoE layer has no next layer
    assert pol.take_prediction(1) is not None and all(pol.take_prediction(il) is None for il in LAYERS)


def test_a_prediction_the_router_then_does_not_choose_is_dropped() -> None:
    pol, m = dali(slots=2, size=1), CacheModel({il: 2 for il in LAYERS})
    pol.on_route(0, ids((0, 1)), scores((5, 6)), m)
    assert m.state(1, 5) is LoadState.QUEUED
    pol.on_route(1, ids((2, 3)), None, m)  # layer 1 chose 2 and 3: the speculative load of 5 goes
    assert m.state(1, 5) is LoadState.ABSENT and {r.expert for r in m.pending(1)} == {2, 3}
    assert all(r.priority == Priority.REFILL for r in m.pending(1))  # the warm-up's loads, for the next run


def test_dali_prefetch_refuses_what_it_cannot_use() -> None:
    for bad in (dict(size=0), dict(window=0), dict(update=0)):
        with pytest.raises(PrefetchError):
            dali(**bad)  # type: ignore[arg-type]
    assert dali_default_prefetch(8) == 1 and dali_default_prefetch(128) == 4
