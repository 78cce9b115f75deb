"""CPU/GPU expert assignment (edgemoe.policies.assignment): pure, no native library."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from edgemoe.errors import AssignmentError, AssignmentTooLargeError, EdgeMoeError
from edgemoe.policies.assignment import (
    MAX_BRUTE_FORCE_EXPERTS,
    MAX_EXACT_EXPERTS,
    CostModel,
    MissAction,
    TransferMode,
    decode_miss_choice,
    decode_miss_costs,
    exact_assign,
    greedy_assign,
    make_assigner,
    optimal_assign,
    ratio_assign,
    workload_from_ids,
)

US = 1e-6


def affine(cpu: tuple[float, float], gpu: tuple[float, float], transfer: float, *, handoff: float = 0.0,
           mode: TransferMode = TransferMode.PIPELINED, split: float = 0.0) -> CostModel:
    return CostModel.affine(cpu_fixed_s=cpu[0], cpu_per_token_s=cpu[1], gpu_fixed_s=gpu[0],
                            gpu_per_token_s=gpu[1], transfer_s=transfer, cpu_handoff_s=handoff,
                            transfer_mode=mode, split_overhead_s=split)


def brute_makespan(workload: dict[int, int], resident: set[int], cost: CostModel) -> float:
    """A second brute force, written from the formula alone: every placement, plain Python."""
    active = [e for e in sorted(workload) if workload[e] > 0]
    best = math.inf
    for place in itertools.product((False, True), repeat=len(active)):  # True: GPU
        t_cpu = t_gpu = 0.0
        for e, on_gpu in zip(active, place, strict=False):
            w = workload[e]
            if not on_gpu:
                t_cpu += cost.cpu_s(w)
            elif e in resident:
                t_gpu += cost.gpu_s(w)
            elif cost.transfer_mode is TransferMode.PIPELINED:
                t_gpu += max(cost.transfer_s(), cost.gpu_s(w))
            else:
                t_gpu += cost.transfer_s() + cost.gpu_s(w)
        if not all(place):
            t_cpu += cost.cpu_handoff_s
        best = min(best, max(t_cpu, t_gpu))
    return best if active else 0.0


SOLVERS = [greedy_assign, ratio_assign, optimal_assign, exact_assign]


@pytest.mark.parametrize("solve", SOLVERS)
def test_all_resident_runs_on_the_gpu(solve) -> None:  # type: ignore[no-untyped-def]
    cost = affine((40 * US, 16 * US), (15 * US, 0.8 * US), 220 * US, handoff=100 * US)
    work = {0: 5, 3: 40, 7: 1, 9: 12}
    a = solve(work, {0, 3, 7, 9, 11}, cost)
    assert a.gpu == (0, 3, 7, 9) and a.cpu == () and a.load == ()
    assert a.t_cpu == 0.0 and a.t_transfer == 0.0
    assert a.makespan == pytest.approx(4 * 15 * US + 58 * 0.8 * US)


@pytest.mark.parametrize("solve", SOLVERS)
def test_tiny_workloads_stay_on_the_cpu(solve) -> None:  # type: ignore[no-untyped-def]
    cost = affine((2 * US, 1 * US), (10 * US, 0.1 * US), 500 * US)
    a = solve({1: 1, 2: 2, 5: 1, 6: 3}, set(), cost)
    assert a.cpu == (1, 2, 5, 6) and a.gpu == () and a.load == ()
    assert a.makespan == pytest.approx(4 * 2 * US + 7 * US)


@pytest.mark.parametrize("solve", SOLVERS)
def test_one_huge_expert_goes_to_the_gpu(solve) -> None:  # type: ignore[no-untyped-def]
    cost = affine((0.0, 10 * US), (5 * US, 0.1 * US), 200 * US)
    a = solve({0: 2, 1: 3, 2: 5000, 3: 1}, set(), cost)
    assert a.gpu == (2,) and a.load == (2,) and a.cpu == (0, 1, 3)
    assert a.t_gpu == pytest.approx(max(200 * US, 505 * US))  # pipelined: max(copy, compute)
    assert a.t_cpu == pytest.approx(60 * US)


def test_hand_computed_optimum_in_both_transfer_modes() -> None:
    # cpu = 10 w, gpu = w, copy 5; workloads 1, 2, 10, nothing resident
    work = {0: 1, 1: 2, 2: 10}
    pipe = affine((0.0, 10.0), (0.0, 1.0), 5.0)
    # GPU times max(5, w) = 5, 5, 10: all GPU 20; expert 0 on the CPU: max(10, 15) = 15
    for solve in SOLVERS:
        a = solve(work, set(), pipe)
        assert (a.cpu, a.gpu, a.makespan) == ((0,), (1, 2), 15.0)
    serial = affine((0.0, 10.0), (0.0, 1.0), 5.0, mode=TransferMode.SERIAL)
    # GPU times w + 5 = 6, 7, 15: all GPU 28; {0} CPU max(10, 22); {1} CPU max(20, 21) = 21 best
    for solve in (greedy_assign, optimal_assign, exact_assign):
        a = solve(work, set(), serial)
        assert (a.cpu, a.gpu, a.t_cpu, a.t_gpu) == ((1,), (0, 2), 20.0, 21.0)
        assert a.t_transfer == 10.0
    # ratios c/g = 10/6, 20/7, 100/15: order 2, 1, 0; the cuts give 130, 30, 22, 28: one above the optimum
    r = ratio_assign(work, set(), serial)
    assert (r.cpu, r.gpu, r.makespan) == ((0,), (1, 2), 22.0)


def test_greedy_is_dalis_single_pass_and_can_miss_the_optimum() -> None:
    # equal CPU and GPU times (all resident, no hand-off): every |g - c| ties, ids in order.
    # Algorithm 1 puts 3 on the GPU, 3 on the CPU, 2 GPU, 2 CPU, 2 GPU: 7; the optimum is 3+3 | 2+2+2 = 6
    cost = affine((0.0, 1.0), (0.0, 1.0), 0.0)
    work = {0: 3, 1: 3, 2: 2, 3: 2, 4: 2}
    g = greedy_assign(work, set(work), cost)
    assert (g.gpu, g.cpu, g.makespan) == ((0, 2, 4), (1, 3), 7.0)
    assert optimal_assign(work, set(work), cost).makespan == 6.0
    # every ratio is 1: the cuts of the id order; the first two on the GPU balance at 6
    r = ratio_assign(work, set(work), cost)
    assert (r.gpu, r.cpu, r.makespan) == ((0, 1), (2, 3, 4), 6.0)


def test_ratio_fills_the_gpu_with_the_experts_the_cpu_is_worst_at() -> None:
    # transfer-bound GPU (pipelined, nothing resident): every expert costs its copy, 10, on the GPU,
    # so the CPU should take the smallest workloads: GPU {23, 19} = 20, CPU 13 + 12 + 4 + 1 = 30.
    # DALI visits by |g - c| (23, 19, 1, 4, 13, 12) and alternates: GPU {23, 1, 13} = 30, CPU {19, 4, 12} = 35
    cost = affine((0.0, 1.0), (0.0, 0.1), 10.0)
    work = {0: 23, 1: 19, 2: 13, 3: 12, 4: 4, 5: 1}
    r, g = ratio_assign(work, set(), cost), greedy_assign(work, set(), cost)
    assert (r.gpu, r.makespan) == ((0, 1), 30.0) and optimal_assign(work, set(), cost).makespan == 30.0
    assert (g.gpu, g.cpu, g.makespan) == ((0, 2, 5), (1, 3, 4), 35.0)


def random_instance(rng: np.random.Generator, n_max: int) -> tuple[dict[int, int], set[int], CostModel]:
    n = int(rng.integers(0, n_max + 1))
    experts = rng.choice(64, size=n, replace=False)
    # skewed workloads as routing gives them, with some zeros (not active)
    work = {int(e): int(rng.geometric(rng.uniform(0.01, 0.5))) - 1 for e in experts}
    resident = {int(e) for e in rng.choice(64, size=int(rng.integers(0, 16)), replace=False)}
    cost = affine((rng.uniform(0, 50) * US, rng.uniform(1, 20) * US), (rng.uniform(0, 20) * US, rng.uniform(0.05, 2) * US),
                  rng.uniform(10, 400) * US, handoff=float(rng.choice([0.0, rng.uniform(0, 500) * US])),
                  mode=TransferMode.PIPELINED if rng.random() < 0.5 else TransferMode.SERIAL)
    return work, resident, cost


def test_greedy_never_beats_the_optimum_and_solvers_agree() -> None:
    rng = np.random.default_rng(12)
    ratios = []
    for _ in range(300):
        work, resident, cost = random_instance(rng, 10)
        g, r, o, x = (solve(work, resident, cost) for solve in SOLVERS)
        ref = brute_makespan(work, resident, cost)
        assert o.makespan == pytest.approx(ref, rel=1e-12, abs=1e-15)
        assert x.makespan == pytest.approx(ref, rel=1e-12, abs=1e-15)
        assert g.makespan >= ref * (1 - 1e-12)
        assert r.makespan >= ref * (1 - 1e-12)
        # the ratio cut's bound: the optimum plus min(c_e, g_e) of one expert
        p_c = [cost.cpu_s(w) for w in work.values() if w > 0]
        p_g = [cost.gpu_s(w) + (cost.transfer_s() if cost.transfer_mode is TransferMode.SERIAL else 0.0)
               for w in work.values() if w > 0]
        slack = max((min(c, max(gg, cost.transfer_s())) for c, gg in zip(p_c, p_g, strict=False)), default=0.0)
        assert r.makespan <= ref + slack + 1e-12
        for a in (g, r, o, x):  # a placement: every active expert once, loads = the non-resident GPU ones
            assert sorted(a.cpu + a.gpu) == sorted(e for e, w in work.items() if w > 0)
            assert set(a.load) == set(a.gpu) - resident
        ratios.append(g.makespan / ref if ref else 1.0)
    assert max(ratios) > 1.0  # the instances are not all easy ones


def test_exact_matches_brute_force_beyond_ten_experts() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        work, resident, cost = random_instance(rng, MAX_BRUTE_FORCE_EXPERTS)
        assert exact_assign(work, resident, cost).makespan == pytest.approx(
            optimal_assign(work, resident, cost).makespan, rel=1e-12, abs=1e-15)


def test_exact_scales_to_all_32_experts() -> None:
    rng = np.random.default_rng(5)
    work = {e: int(rng.integers(1, 200)) for e in range(32)}
    cost = affine((40 * US, 16 * US), (15 * US, 0.8 * US), 220 * US, handoff=300 * US)
    x, g = exact_assign(work, set(range(8)), cost), greedy_assign(work, set(range(8)), cost)
    assert x.makespan <= g.makespan
    # the optimum balances the two sides to within one expert's time
    assert abs(x.t_cpu - x.t_gpu) <= max(cost.cpu_s(w) for w in work.values())


def test_solvers_refuse_too_many_experts() -> None:
    cost = affine((0.0, 1.0), (0.0, 1.0), 1.0)
    with pytest.raises(AssignmentTooLargeError, match="exact_assign"):
        optimal_assign({e: 1 for e in range(MAX_BRUTE_FORCE_EXPERTS + 1)}, set(), cost)
    with pytest.raises(AssignmentTooLargeError, match="greedy_assign"):
        exact_assign({e: 1 for e in range(MAX_EXACT_EXPERTS + 1)}, set(), cost)
    # inactive experts do not count
    optimal_assign({e: int(e < 3) for e in range(64)}, set(), cost)


def test_assigners_by_name() -> None:
    assert make_assigner("greedy") is greedy_assign and make_assigner("ratio") is ratio_assign
    assert make_assigner("exact") is exact_assign and make_assigner("brute-force") is optimal_assign
    with pytest.raises(AssignmentError, match="use one of greedy, ratio"):
        make_assigner("lpt")


def test_bad_inputs_raise_typed_errors() -> None:
    cost = affine((0.0, 1.0), (0.0, 1.0), 1.0)
    with pytest.raises(AssignmentError, match="negative"):
        greedy_assign({0: -1}, set(), cost)
    with pytest.raises(AssignmentError, match="finite"):
        greedy_assign({0: 1}, set(), CostModel(cpu_s=lambda n: math.nan, gpu_s=lambda n: 1.0, transfer_s=lambda: 1.0))
    with pytest.raises(AssignmentError, match="strictly increasing"):
        CostModel.from_table(tokens=[4, 2], cpu_s=[1.0, 2.0], gpu_s=[1.0, 2.0], transfer_s=1.0)
    with pytest.raises(AssignmentError, match=">= 0"):
        affine((0.0, -1.0), (0.0, 1.0), 1.0)
    with pytest.raises(EdgeMoeError, match="transfer mode"):
        CostModel(cpu_s=float, gpu_s=float, transfer_s=float, transfer_mode="overlap")  # type: ignore[arg-type]
    assert greedy_assign({}, set(), cost).makespan == 0.0


def test_table_cost_model_interpolates_and_extrapolates() -> None:
    cost = CostModel.from_table(tokens=[1, 8, 64], cpu_s=[1.0, 8.0, 36.0], gpu_s=[2.0, 2.0, 3.0], transfer_s=4.0)
    assert cost.cpu_s(1) == 1.0 and cost.cpu_s(4) == pytest.approx(4.0) and cost.cpu_s(36) == pytest.approx(22.0)
    assert cost.cpu_s(128) == pytest.approx(36.0 + 0.5 * 64)  # the last segment's slope
    assert cost.gpu_s(120) == pytest.approx(3.0 + 56 / 56)
    assert cost.transfer_s() == 4.0


def test_workload_from_ids_counts_tokens_and_skips_dropped_slots() -> None:
    ids = np.array([[0, 3], [3, -1], [5, 3]], dtype=np.int32)
    assert workload_from_ids(ids) == {0: 1, 3: 3, 5: 1}


def test_decode_miss_picks_the_cpu_when_the_copy_is_slow() -> None:
    cost = affine((5 * US, 0.0), (5 * US, 0.0), 200 * US, split=10 * US)
    assert decode_miss_choice(1, cost) is MissAction.CPU


def test_decode_miss_waits_when_the_copy_is_fast() -> None:
    cost = affine((1000 * US, 0.0), (5 * US, 0.0), 10 * US, split=10 * US)
    costs = decode_miss_costs(1, cost)
    # split: f = 15 / 1015 of the rows on the CPU (~14.8 us) + 10 us overhead > 15 us waiting
    assert costs[MissAction.WAIT] == pytest.approx(15 * US)
    assert costs[MissAction.SPLIT] == pytest.approx(1000 * US * 15 / 1015 + 10 * US)
    assert decode_miss_choice(1, cost) is MissAction.WAIT


def test_decode_miss_splits_when_both_sides_are_comparable() -> None:
    cost = affine((100 * US, 0.0), (10 * US, 0.0), 90 * US, split=1 * US)
    costs = decode_miss_costs(1, cost)
    assert costs[MissAction.SPLIT] == pytest.approx(51 * US)  # half the rows each: 50 us + 1 us
    assert decode_miss_choice(1, cost) == "split"


def test_decode_miss_does_not_split_when_the_handoff_exceeds_waiting() -> None:
    cost = affine((100 * US, 0.0), (10 * US, 0.0), 40 * US, handoff=60 * US)
    assert math.isinf(decode_miss_costs(1, cost)[MissAction.SPLIT])
    assert decode_miss_choice(1, cost) is MissAction.WAIT
    with pytest.raises(AssignmentError, match=">= 1"):
        decode_miss_choice(0, cost)
