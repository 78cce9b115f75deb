"""The routing model calibrated on a real trace: its traces keep the source's concentration and reuse,
and an LRU cache sees about the hit rate it sees on the real routing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe import Engine, LoadConfig
from edgemoe.analysis.routing_model import RoutingStats, routing_stats, synthesize_trace
from edgemoe.analysis.trace import DECODE, record_trace
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
from edgemoe.errors import EdgeMoeError
from edgemoe.policies.residency import LruPolicy, replay_policy

from helpers.models import FIXTURE_MODELS


def _real_trace(model: Path):  # type: ignore[no-untyped-def]
    text = split_corpus(default_corpus_dir() / "python-docs.txt").train_text()[:40000]
    with Engine(model, LoadConfig(n_ctx=256, n_threads=2)) as eng:
        return record_trace(eng, eng.tokenize(text)[:1536], ctx=256, mode="decode", prefill_tokens=64)


def _decode_lru_hit(trace, slots: int) -> float:  # type: ignore[no-untyped-def]
    layers = list(range(trace.ids.shape[1]))
    rows = np.flatnonzero(trace.phase == DECODE)
    steps = [[(j, trace.ids[r:r + 1, j, :]) for j in layers] for r in rows]
    return replay_policy(LruPolicy({j: slots for j in layers}), steps).hit_rate


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_synthesized_routing_keeps_the_source_statistics(model: Path) -> None:
    real = _real_trace(model)
    stats = routing_stats(real)
    e, k = real.n_expert, real.ids.shape[2]
    syn = synthesize_trace(stats, n_expert=e, k=k, n_layer=real.ids.shape[1], n_seq=6, prefill=64, decode=192)
    again = routing_stats(syn)
    assert np.abs(again.reuse - stats.reuse).max() < 0.08
    assert np.abs(again.mass - stats.mass).max() < 0.08
    for slots in (e // 4, e // 2):
        assert abs(_decode_lru_hit(syn, slots) - _decode_lru_hit(real, slots)) < 0.06
    # a uniform router (no concentration, no reuse) is far from it: the check above can fail
    flat = RoutingStats(mass=np.tile(np.linspace(0, 1, stats.mass.shape[1]), (stats.mass.shape[0], 1)),
                           reuse=np.zeros_like(stats.reuse))
    uniform = synthesize_trace(flat, n_expert=e, k=k, n_layer=real.ids.shape[1], n_seq=6, prefill=64, decode=192)
    assert _decode_lru_hit(real, e // 4) - _decode_lru_hit(uniform, e // 4) > 0.06


def test_synthesized_routing_scales_to_other_shapes_and_says_what_it_is() -> None:
    source = RoutingStats(mass=np.sqrt(np.linspace(0, 1, 65))[None, :].repeat(2, 0), reuse=np.array([0.3, 0.5]))
    stats = routing_stats(synthesize_trace(source, n_expert=32, k=4, n_layer=2, n_seq=2, prefill=32, decode=64))
    big = synthesize_trace(stats, n_expert=128, k=8, n_layer=6, n_seq=2, prefill=16, decode=32)
    assert big.ids.shape == (96, 6, 8) and big.meta["synthetic_routing"] is True
    assert all(len(set(row)) == 8 for row in big.ids.reshape(-1, 8).tolist())  # k distinct experts per token
    assert big.ids.min() >= 0 and big.ids.max() < 128
    with pytest.raises(EdgeMoeError, match="routing shape"):
        synthesize_trace(stats, n_expert=4, k=8, n_layer=1, n_seq=1, prefill=1, decode=1)
