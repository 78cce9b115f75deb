"""`edgemoe profile`'s checks and host fit on synthetic timing tables (no native library, no timing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgemoe.perf.model.host_fit import bounded_least_squares, fit_host_terms
from edgemoe.perf.model.profile_checks import (
    Position,
    TimingTable,
    find_suspects,
    repair,
    settle,
)

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
BYTES_PER_WEIGHT = np.array([0.5625, 0.6875, 0.8203125, 1.0625])
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WEIGHTS = np.array([3 * 512 * 256, 3 * 2048 * 768])


def _table(hot: bool = False) -> TimingTable:
    """A consistent expert table: 10 us + c us fixed, memory-bound at 20 GB/s until the multiply-adds
    (2 per weight and token at 200 Gflop/s) take longer."""
    nbytes = BYTES_PER_WEIGHT[:, None] * WEIGHTS[None, :]
    c = np.array(COUNTS, float)
    fixed = 10e-6 + 1e-6 * c
    memory = nbytes[:, :, None] / 20e9
    compute = 2 * WEIGHTS[None, :, None] * c[None, None, :] / 200e9
    times = fixed[None, None, :] + np.maximum(memory, compute)
    return TimingTable("expert", hot, TYPES, ("512x256", "2048x768"), COUNTS, nbytes, times)


def _with(table: TimingTable, pos: Position, factor: float) -> TimingTable:
    times = table.times.copy()
    times[pos] *= factor
    return dataclasses.replace(table, times=times)


def test_a_consistent_table_has_no_suspects() -> None:
    assert find_suspects(_table()) == []
    assert find_suspects(_table(hot=True)) == []


def test_a_spike_contradicts_the_larger_token_counts_and_is_flagged() -> None:
    clean = _table()
    spiked = _with(clean, (0, 1, 6), 3.0)  # Q4_K 2048x768 at 64 tokens: 3x its time
    suspects = find_suspects(spiked)
    assert [s.pos for s in suspects] == [(0, 1, 6)]
    assert "128 tokens" in suspects[0].reason


def test_the_two_size_fit_flags_a_small_weight_as_slow_as_the_large_one() -> None:
    clean = _table()
    pos = (2, 0, 0)  # Q6_K 512x256 at 1 token
    spiked = _with(clean, pos, clean.times[2, 1, 0] / clean.times[pos] * 1.1)
    assert pos in [s.pos for s in find_suspects(spiked)]
    too_dear = _with(clean, (2, 1, 0), 30.0)  # the large one far dearer per byte than the small one
    assert (2, 1, 0) in [s.pos for s in find_suspects(too_dear)]


def test_the_type_order_is_checked_where_the_weights_stream_from_memory_only() -> None:
    clean = _table()
    times = clean.times.copy()
    times[0] *= 2.5  # Q4_K's whole curve 2.5x as slow: slower than Q8_0, which has more bytes per weight
    slow_q4 = dataclasses.replace(clean, times=times)
    suspects = find_suspects(slow_q4)
    assert [s.pos for s in suspects] == [(0, si, ci) for si in (0, 1) for ci in (0, 1)]  # 1 and 2 tokens
    assert "Q5_K" in suspects[0].reason and "bytes per weight" in suspects[0].reason
    # from 4 tokens on the kernels' arithmetic decides: a type 3x slower there is no contradiction
    times = clean.times.copy()
    times[0, :, 2:] *= 3.0
    assert find_suspects(dataclasses.replace(clean, times=times)) == []
    # hot weights: the order is not checked at all
    assert find_suspects(dataclasses.replace(slow_q4, hot=True)) == []


def test_repair_interpolates_a_point_from_its_curve() -> None:
    clean = _table()
    spiked = _with(clean, (0, 1, 6), 3.0)
    fixed = repair(spiked, {(0, 1, 6)})
    assert fixed[0, 1, 6] == pytest.approx(clean.times[0, 1, 6], rel=0.2)
    untouched = np.ones(fixed.shape, bool)
    untouched[0, 1, 6] = False
    assert np.array_equal(fixed[untouched], spiked.times[untouched])
    # the ends of a curve: flat below the first good point, the last two points' slope above the last
    low = repair(_with(clean, (1, 1, 0), 5.0), {(1, 1, 0)})
    assert low[1, 1, 0] == pytest.approx(clean.times[1, 1, 1])
    high = repair(_with(clean, (1, 1, 9), 5.0), {(1, 1, 9)})
    assert high[1, 1, 9] == pytest.approx(clean.times[1, 1, 9], rel=0.1)


def test_repair_falls_back_to_the_other_types_scaled_by_bytes() -> None:
    clean = _table()
    whole = {(3, 1, ci) for ci in range(len(COUNTS))}
    fixed = repair(clean, whole)
    assert fixed[3, 1, 0] == pytest.approx(clean.times[3, 1, 0], rel=0.3)


def _replay(readings: dict[Position, list[float]]):
    calls: list[list[Position]] = []

    def remeasure(positions: list[Position]) -> dict[Position, list[float]]:
        calls.append(list(positions))
        return {p: [readings[p].pop(0), readings[p].pop(0)] for p in positions}

    return remeasure, calls


def test_settle_takes_the_median_when_a_spike_goes_away() -> None:
    clean = _table()
    pos = (0, 1, 6)
    t = float(clean.times[pos])
    remeasure, calls = _replay({pos: [t * 1.02, t * 0.99]})
    table, notes = settle(_with(clean, pos, 3.0), remeasure)
    assert calls == [[pos]] and notes == []
    assert table.times[pos] == pytest.approx(t * 1.02)


def test_settle_repairs_a_contradiction_that_does_not_reproduce() -> None:
    clean = _table()
    pos = (0, 1, 6)
    t = float(clean.times[pos])
    remeasure, calls = _replay({pos: [t * 2.5, t * 4.0, t * 3.5, t * 2.2]})
    table, notes = settle(_with(clean, pos, 3.0), remeasure)
    assert len(calls) == 2  # two rounds, each timing it twice more
    assert [(n.qtype, n.size, n.tokens, n.action) for n in notes] == [("Q4_K", "2048x768", 64, "repaired")]
    assert len(notes[0].readings_s) == 5 and notes[0].readings_s[0] == pytest.approx(3 * t)
    assert table.times[pos] == pytest.approx(t, rel=0.2) == notes[0].value_s
    assert find_suspects(table) == []


def test_settle_keeps_a_contradiction_the_remeasurements_reproduce() -> None:
    """A kernel that is really slower at one count (a path switch) is not noise: it is kept, with a note."""
    clean = _table()
    pos = (1, 1, 3)
    t = float(clean.times[pos])
    slow = _with(clean, pos, 3.0)
    remeasure, calls = _replay({pos: [t * 3.05, t * 2.98]})
    table, notes = settle(slow, remeasure)
    assert len(calls) == 1
    assert [n.action for n in notes] == ["confirmed"]
    assert table.times[pos] == pytest.approx(3 * t, rel=0.05) == notes[0].value_s


def test_non_finite_times_are_suspects() -> None:
    bad = _with(_table(), (2, 0, 4), float("nan"))
    assert [s.pos for s in find_suspects(bad)] == [(2, 0, 4)]


# --------------------------------------------------------------------------- host terms

PROBE_NODES = np.array([150.0, 290.0, 570.0, 150.0])
PROBE_VOCAB = np.array([1024.0, 1024.0, 1024.0, 65536.0])
TRUE_TERMS = (20e-6, 0.4e-6, 7e-9)  # call_s, node_s, vocab_s


def _runs(noise: float, reps: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    nodes, vocab = np.repeat(PROBE_NODES, reps), np.repeat(PROBE_VOCAB, reps)
    call, node, per_vocab = TRUE_TERMS
    exact = call + node * nodes + per_vocab * vocab
    return nodes, vocab, exact * (1 + noise * rng.standard_normal(exact.size))


def test_host_fit_recovers_known_terms_from_noisy_runs() -> None:
    for seed in range(5):
        fit = fit_host_terms(*_runs(0.02, seed=seed), node_floor=0.1e-6)
        assert fit.call_s == pytest.approx(TRUE_TERMS[0], abs=10e-6)
        assert fit.node_s == pytest.approx(TRUE_TERMS[1], rel=0.15)
        assert fit.vocab_s == pytest.approx(TRUE_TERMS[2], rel=0.1)
        assert fit.at_floor == ()


def test_host_fit_keeps_every_term_at_or_above_its_floor() -> None:
    """Remainders too small for the call term (an exact solve of three probes gives it negative): the fit puts
    it at 0 and fits the others, and the node cost never goes below its floor."""
    nodes, vocab, rest = _runs(0.0)
    rest = rest - 60e-6
    exact = np.linalg.lstsq(np.column_stack([np.ones_like(nodes), nodes, vocab]), rest, rcond=None)[0]
    assert exact[0] < 0
    fit = fit_host_terms(nodes, vocab, rest, node_floor=0.3e-6)
    assert fit.call_s == 0.0 and fit.node_s >= 0.3e-6 and fit.vocab_s > 0
    assert "call_s" in fit.at_floor
    high_floor = fit_host_terms(nodes, vocab, rest + 60e-6, node_floor=1e-6)
    assert high_floor.node_s == pytest.approx(1e-6) and "node_s" in high_floor.at_floor


def test_bounded_least_squares_matches_a_reference_solver() -> None:
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(3)
    for _ in range(20):
        a = rng.standard_normal((9, 3)) * np.array([1.0, 300.0, 6e4])
        b = rng.standard_normal(9)
        lower = np.array([0.0, -0.001, 0.0])
        ours = bounded_least_squares(a, b, lower)
        ref = optimize.lsq_linear(a, b, bounds=(lower, np.inf), tol=1e-12).x
        assert np.linalg.norm(a @ ours - b) <= np.linalg.norm(a @ ref - b) * (1 + 1e-6)
        assert (ours >= lower - 1e-12).all()


def test_an_expert_reading_faster_than_its_types_matmul_from_memory_is_priced_at_the_matmuls_rate() -> None:
    """Cold, at one or two tokens, an expert's products and a dense matmul both stream their weights from memory:
    an expert rate faster per byte (the microbenchmark's pool held in a cache, as on a 2-core AMD EPYC VM) is
    flagged and priced at the matmul's; hot, or at more tokens, the expert's own rate stands."""
    from edgemoe.perf.model.costmodel import _per_byte, cached_expert_reads, expert_per_byte
    from edgemoe.perf.model.profile import Curve, load_profile

    spec = load_profile("rtx4060-laptop").cpu
    matmul = spec.matmul_curve("Q4_K")  # the roofline's: a specification profile measured none
    cpu = dataclasses.replace(spec, matmul={"Q4_K": matmul}, expert={"Q4_K": matmul})
    fast = Curve(tuple(dataclasses.replace(p, s_per_byte=p.s_per_byte / 2) for p in matmul.points))
    dev = dataclasses.replace(cpu, expert={"Q4_K": fast})
    assert cached_expert_reads(cpu) == []
    notes = cached_expert_reads(dev)
    assert len(notes) == 2 and all("Q4_K experts read" in n and "priced at the matmuls' rate" in n for n in notes)
    for t in (1, 2):
        assert expert_per_byte(dev, "Q4_K", t, False) == _per_byte(matmul, t, False) > _per_byte(fast, t, False)
    assert expert_per_byte(dev, "Q4_K", 8, False) == _per_byte(fast, 8, False)  # compute-bound: its own
    assert expert_per_byte(dev, "Q4_K", 1, True) == _per_byte(fast, 1, True)  # hot: its own
    assert expert_per_byte(cpu, "Q4_K", 1, False) == _per_byte(cpu.expert_curve("Q4_K"), 1, False)
