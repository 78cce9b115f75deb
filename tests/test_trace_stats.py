"""Trace statistics on hand-made traces with known answers, and the trace-stats CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from edgemoe.analysis.trace import DECODE, PREFILL, Trace
from edgemoe.analysis.trace_stats import (
    adjacency_matrix,
    compute_stats,
    gate_input_cosine,
    gate_reuse_recall,
    high_workload_adjacency,
    lru_hit_rates,
    prefill_decode_similarity,
    prompt_coverage,
    reuse_distances,
    reuse_within,
    temporal_locality,
    workload_windows,
)
from edgemoe.cli import cli


def _trace(ids: np.ndarray, n_expert: int, **kw) -> Trace:  # type: ignore[no-untyped-def]
    T, L, k = ids.shape
    base = dict(tokens=np.arange(T, dtype=np.int32), layers=np.arange(L, dtype=np.int32), ids=ids.astype(np.int32),
                weights=np.full((T, L, k), 1.0 / k, np.float32), phase=np.zeros(T, np.uint8),
                seq=np.zeros(T, np.int32), meta={"n_expert": n_expert})
    base.update(kw)
    return Trace(**base)  # type: ignore[arg-type]


def test_temporal_locality_known() -> None:
    # layer 0: the same experts every token -> 1.0; layer 1: disjoint consecutive sets -> 0.0
    T = 6
    ids = np.zeros((T, 2, 2), np.int32)
    ids[:, 0] = [0, 1]
    ids[:, 1] = [[0, 1] if t % 2 == 0 else [2, 3] for t in range(T)]
    np.testing.assert_allclose(temporal_locality(ids, np.zeros(T, np.int32), 4), [1.0, 0.0])
    # a sequence boundary between every pair: no pairs, no NaN
    assert np.isfinite(temporal_locality(ids, np.arange(T, dtype=np.int32), 4)).all()


def test_frequency_entropy_skew() -> None:
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permutation(8)[:2] for _ in range(4000)])[:, None, :]
    hot = np.tile([0, 1], (4000, 1))[:, None, :]
    st = compute_stats(_trace(np.concatenate([uniform, hot], 1), 8))
    assert st.entropy[0] > 0.99 and abs(st.entropy[1] - np.log(2) / np.log(8)) < 1e-9
    assert abs(st.skew[1] - 4.0) < 1e-9  # hottest share 0.5 x 8 experts
    np.testing.assert_allclose(st.frequency.sum(1), 1.0)


def test_high_workload_adjacency_known() -> None:
    work = np.zeros((1, 3, 4))
    work[0, 0] = [5, 4, 0, 0]  # top-2 {0, 1}
    work[0, 1] = [5, 0, 4, 0]  # top-2 {0, 2}: 1 of 2 kept
    work[0, 2] = [5, 0, 4, 0]  # top-2 {0, 2}: 2 of 2 kept
    np.testing.assert_allclose(high_workload_adjacency(work, 2), [0.75])
    m = adjacency_matrix(work, 2)[0]
    assert m[0, 0] == 2 and m[1, 2] == 1 and m[2, 2] == 1 and m.sum() == 8  # 2 window pairs x 2 x 2
    ids = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]])
    assert workload_windows(ids, 4, 2).tolist() == [[[2, 2, 0, 0], [0, 0, 2, 2]]]


def test_gate_input_cosine_and_reuse() -> None:
    T, D, E = 50, 6, 5
    rng = np.random.default_rng(1)
    x = rng.normal(size=(T, D)).astype(np.float32)
    g = np.stack([x, x, -x], 1)  # layer 1 input == layer 0 input; layer 2 the opposite
    np.testing.assert_allclose(gate_input_cosine(g), [1.0, -1.0], atol=1e-5)
    router = rng.normal(size=(E, D)).astype(np.float32)
    logits = x @ router.T
    top = np.argsort(-logits, 1, kind="stable")[:, :2]
    bottom = np.argsort(logits, 1, kind="stable")[:, :2]
    ids = np.stack([top, top, bottom], 1)
    rec = gate_reuse_recall(ids, g, {0: router, 1: router, 2: router}, [0, 1, 2])
    assert rec[0] == 1.0  # layer 1 routed as its router does on layer 0's input: perfect prediction
    assert rec[1] == 0.0  # layer 2 took the least likely experts of that prediction


def test_prefill_decode_similarity() -> None:
    ids = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]])
    phase = np.array([PREFILL, PREFILL, DECODE, DECODE], np.uint8)
    assert prefill_decode_similarity(ids, phase, 4)[0] == 0.0
    assert prefill_decode_similarity(ids, np.zeros(4, np.uint8), 4) is None
    same = np.array([PREFILL, DECODE, PREFILL, DECODE], np.uint8)
    assert abs(prefill_decode_similarity(ids, same, 4)[0] - 1.0) < 1e-12


def test_lru_hit_rates_known() -> None:
    ids = np.array([[[0]], [[1]], [[0]], [[1]], [[2]], [[0]]])  # k=1, one layer
    r = lru_hit_rates(ids, 3, np.array([1, 2, 3]))
    # size 1: no hits; size 2: hits at t=2, t=3 -> 2/6; size 3: hits at t=2, 3, 5 -> 3/6
    np.testing.assert_allclose(r[0], [0.0, 2 / 6, 3 / 6])


def test_lru_hit_rates_count_after_warmup() -> None:
    ids = np.array([[[0]], [[1]], [[0]], [[1]], [[2]], [[0]]])
    # size 2, counted from token 3: hits at t=3 only (t=5 misses: 0 was evicted by 2) -> 1/3
    np.testing.assert_allclose(lru_hit_rates(ids, 3, np.array([2]), count_from=3)[0], [1 / 3])


def test_reuse_over_a_window_known() -> None:
    # one layer, k=2; sequence 0: {0,1} {1,2} {3,4} {0,5}; sequence 1 starts afresh: {0,1} {0,1}
    ids = np.array([[0, 1], [1, 2], [3, 4], [0, 5], [0, 1], [0, 1]])[:, None, :]
    seq = np.array([0, 0, 0, 0, 1, 1])
    d = reuse_distances(ids, seq)
    assert d[1, 0].tolist() == [1.0, np.inf] and d[3, 0].tolist() == [3.0, np.inf] and np.isinf(d[4]).all()
    # tokens with a predecessor: t=1,2,3,5 (8 selections); within 1: 1 (t=1) + 2 (t=5) -> 3/8
    np.testing.assert_allclose(reuse_within(d, seq, 1), [3 / 8])
    np.testing.assert_allclose(reuse_within(d, seq, 3), [4 / 8])  # + expert 0 at t=3, three tokens back


def test_prompt_coverage_known() -> None:
    # 4 experts, share 0.5 -> the top 2; sequence 0 uses only 0 and 1, sequence 1 only 2 and 3
    ids = np.array([[0, 1]] * 3 + [[2, 3]] * 3)[:, None, :]
    own, other = prompt_coverage(ids, np.array([0, 0, 0, 1, 1, 1]), 4, 0.5)
    assert own == 1.0 and other == 0.0  # each sequence's top half is the other's unused half
    assert prompt_coverage(ids[:3], np.zeros(3, int), 4, 0.5) == (1.0, None)


def test_trace_stats_cli(tmp_path: Path) -> None:
    from helpers.models import FIXTURE_MODELS

    model = FIXTURE_MODELS[-1]
    inp = tmp_path / "in.txt"
    inp.write_text("To be, or not to be, that is the question. The list type is mutable.\n" * 30)
    out = tmp_path / "t.npz"
    r = CliRunner().invoke(cli, ["trace", str(model), "--input", str(inp), "--out", str(out), "--max-tokens", "300",
                                 "--ctx", "128", "--mode", "decode", "--gate-inputs"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["trace-stats", str(out), "--json", "--plots", str(tmp_path / "plots")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert len(d["gate_reuse_recall"]) == 7 and 0 <= d["mean"]["gate_reuse_recall"] <= 1
    assert d["prefill_decode_similarity"] is not None
    for p in d["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = CliRunner().invoke(cli, ["trace-stats", str(out)], catch_exceptions=False).output
    assert "temporal locality" in text and "LRU hit rate" in text
