"""CPU/GPU assignment of one MoE layer's experts for one ubatch: DALI's greedy, exact references.

DALI (shared/seeds/001, section 4.1, eq. 3-6, Algorithm 1) runs every active expert of a layer
either on the CPU, from host memory, or on the GPU, copied there first unless it is resident,
and minimises the layer's makespan max(T_cpu, T_gpu): the two sides run in parallel. Here

    T_cpu = H * [some expert on the CPU] + sum over CPU experts of cpu_s(w_e)
    T_gpu = sum over GPU experts of g_e, where
            g_e = gpu_s(w_e)                          if e is resident,
            g_e = max(transfer_s(), gpu_s(w_e))       PIPELINED (DALI eq. 5: the copy of the next
                                                      expert overlaps this one's compute),
            g_e = transfer_s() + gpu_s(w_e)           SERIAL (no copy/compute overlap),

w_e is the number of tokens of the ubatch routed to e and H a fixed hand-off (activations to
the host, the CPU's partial sum back, one sync). DALI's GPU memory bound (eq. 9) is not
modelled: the caller passes only experts it has room to load.

- ``greedy_assign``: DALI's Algorithm 1, O(n log n), as the paper describes it.
- ``ratio_assign``: the best cut of the experts ordered by CPU/GPU time ratio, O(n log n); on
  the fixtures' prefill routes within 1% of the optimum on average (4.9% at worst), where
  DALI's is up to 13% above it on average (37% at worst; docs/research/assignment.md).
- ``optimal_assign``: brute force over the 2^n placements (n <= 20), the reference for tests.
- ``exact_assign``: the same optimum by meet-in-the-middle over Pareto fronts (n <= 40), so
  layers with all 32 experts active can be scored exactly.
- ``decode_miss_choice``: one decode miss: CPU now, wait for the copy, or split the expert.

Pure Python and numpy. Costs come from any ``ExpertCosts`` (``CostModel`` here; a measured
machine profile can implement the same protocol).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import AssignmentError, AssignmentTooLargeError

MAX_BRUTE_FORCE_EXPERTS = 20  # 2^20 placements: ~50 ms and ~40 MB in numpy
MAX_EXACT_EXPERTS = 40  # meet-in-the-middle: two halves of 2^20 subsets each


class TransferMode(str, enum.Enum):
    """How a loaded expert's copy and its GPU compute add up (see the module docstring)."""

    PIPELINED = "pipelined"  # DALI eq. 5: max(transfer, compute) per expert
    SERIAL = "serial"  # transfer + compute per expert


class ExpertCosts(Protocol):
    """The per-layer costs, in seconds, the assignment reads; ``CostModel`` is one implementation."""

    @property
    def cpu_handoff_s(self) -> float: ...
    @property
    def split_overhead_s(self) -> float: ...
    @property
    def transfer_mode(self) -> TransferMode: ...
    def cpu_s(self, tokens: int, /) -> float: ...
    def gpu_s(self, tokens: int, /) -> float: ...
    def transfer_s(self) -> float: ...


@dataclass(frozen=True)
class CostModel:
    """One MoE layer's cost model: three callables and fixed overheads, all in seconds."""

    cpu_s: Callable[[int], float]  # one expert's FFN on the CPU over that many tokens
    gpu_s: Callable[[int], float]  # the same on the GPU, weights resident
    transfer_s: Callable[[], float]  # copy one expert's weights host -> GPU
    cpu_handoff_s: float = 0.0  # once per layer when any expert runs on the CPU
    transfer_mode: TransferMode = TransferMode.PIPELINED
    split_overhead_s: float = 0.0  # decode split: second launch and the add of the two partial sums

    def __post_init__(self) -> None:
        for name in ("cpu_handoff_s", "split_overhead_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise AssignmentError(f"CostModel.{name} is {v}: give a finite time >= 0 in seconds")
        if not isinstance(self.transfer_mode, TransferMode):
            raise AssignmentError(
                f"unknown transfer mode {self.transfer_mode!r}: use one of "
                f"{', '.join(m.value for m in TransferMode)}"
            )

    @classmethod
    def affine(
        cls,
        *,
        cpu_fixed_s: float,
        cpu_per_token_s: float,
        gpu_fixed_s: float,
        gpu_per_token_s: float,
        transfer_s: float,
        cpu_handoff_s: float = 0.0,
        transfer_mode: TransferMode = TransferMode.PIPELINED,
        split_overhead_s: float = 0.0,
    ) -> CostModel:
        """cpu_s(n) = cpu_fixed_s + cpu_per_token_s * n, gpu_s likewise, a constant transfer."""
        values = {
            "cpu_fixed_s": cpu_fixed_s,
            "cpu_per_token_s": cpu_per_token_s,
            "gpu_fixed_s": gpu_fixed_s,
            "gpu_per_token_s": gpu_per_token_s,
            "transfer_s": transfer_s,
        }
        bad = {k: v for k, v in values.items() if not (math.isfinite(v) and v >= 0.0)}
        if bad:
            raise AssignmentError(f"CostModel.affine got {bad}: every time must be finite and >= 0 seconds")
        return cls(
            cpu_s=lambda n: cpu_fixed_s + cpu_per_token_s * n,
            gpu_s=lambda n: gpu_fixed_s + gpu_per_token_s * n,
            transfer_s=lambda: transfer_s,
            cpu_handoff_s=cpu_handoff_s,
            transfer_mode=transfer_mode,
            split_overhead_s=split_overhead_s,
        )

    @classmethod
    def from_table(
        cls,
        *,
        tokens: Sequence[int],
        cpu_s: Sequence[float],
        gpu_s: Sequence[float],
        transfer_s: float,
        cpu_handoff_s: float = 0.0,
        transfer_mode: TransferMode = TransferMode.PIPELINED,
        split_overhead_s: float = 0.0,
    ) -> CostModel:
        """Times measured at a few token counts, interpolated linearly between them.

        Below the first count the first time holds; beyond the last, the last segment's slope
        extends the table (a single point: constant).
        """
        x = np.asarray(tokens, dtype=np.float64)
        cols = {"cpu_s": np.asarray(cpu_s, dtype=np.float64), "gpu_s": np.asarray(gpu_s, dtype=np.float64)}
        if x.ndim != 1 or x.size == 0 or np.any(x < 1) or np.any(np.diff(x) <= 0):
            raise AssignmentError(
                f"cost table token counts {list(tokens)} must be >= 1 and strictly "
                "increasing: measure at e.g. 1, 8, 64, 512 tokens"
            )
        for name, y in cols.items():
            if y.shape != x.shape or not np.all(np.isfinite(y)) or np.any(y < 0):
                raise AssignmentError(
                    f"cost table {name} {list(y)} must hold one finite time >= 0 per token count ({x.size})"
                )
        if not (math.isfinite(transfer_s) and transfer_s >= 0.0):
            raise AssignmentError(f"transfer_s is {transfer_s}: give a finite time >= 0 in seconds")

        xs = [float(v) for v in x]

        def interp(col: np.ndarray) -> Callable[[int], float]:
            ys = [float(v) for v in col]
            # per segment (x0, y0, slope); the last one extends beyond the table
            segs = [(xs[i], ys[i], (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])) for i in range(len(xs) - 1)]
            segs = segs or [(xs[0], ys[0], 0.0)]

            def at(n: int) -> float:  # pure Python: called per expert per ubatch, np.interp is slower
                if n <= xs[0]:
                    return ys[0]
                x0, y0, slope = segs[min(bisect.bisect_right(xs, n) - 1, len(segs) - 1)]
                return y0 + slope * (n - x0)

            return at

        return cls(
            cpu_s=interp(cols["cpu_s"]),
            gpu_s=interp(cols["gpu_s"]),
            transfer_s=lambda: transfer_s,
            cpu_handoff_s=cpu_handoff_s,
            transfer_mode=transfer_mode,
            split_overhead_s=split_overhead_s,
        )


@dataclass(frozen=True)
class Assignment:
    """Where one layer's active experts run for one ubatch, and what that costs (seconds)."""

    cpu: tuple[int, ...]  # experts computed on the CPU, ascending
    gpu: tuple[int, ...]  # experts computed on the GPU (resident or loaded), ascending
    load: tuple[int, ...]  # the experts of `gpu` not resident: copied host -> GPU for this ubatch
    t_cpu: float  # hand-off (when `cpu` is not empty) + CPU compute
    t_gpu: float  # GPU compute with the copies of `load`, per the transfer mode
    t_transfer: float  # the copies alone: len(load) * transfer_s()

    @property
    def makespan(self) -> float:
        return max(self.t_cpu, self.t_gpu)


@dataclass(frozen=True)
class _Problem:
    experts: tuple[int, ...]  # active experts, ascending
    c: tuple[float, ...]  # CPU time of each
    g: tuple[float, ...]  # GPU time of each, with its copy when not resident
    loaded: tuple[bool, ...]  # not resident: running it on the GPU needs a copy
    handoff: float
    transfer: float


def _problem(workload: Mapping[int, int], resident: AbstractSet[int], cost: ExpertCosts) -> _Problem:
    bad = {e: w for e, w in workload.items() if w < 0}
    if bad:
        raise AssignmentError(f"negative workloads {bad}: a workload counts the tokens routed to an expert")
    experts = tuple(sorted(int(e) for e, w in workload.items() if w > 0))
    x = float(cost.transfer_s())
    c = tuple(float(cost.cpu_s(int(workload[e]))) for e in experts)
    gc = tuple(float(cost.gpu_s(int(workload[e]))) for e in experts)
    if not all(0.0 <= t < math.inf for t in (x, *c, *gc)):  # NaN fails too
        bad_w = (
            next(
                int(workload[e])
                for e, ce, ge in zip(experts, c, gc, strict=False)
                if not (0.0 <= ce < math.inf and 0.0 <= ge < math.inf)
            )
            if experts
            else 0
        )
        raise AssignmentError(
            f"the cost model gave cpu_s({bad_w})={cost.cpu_s(bad_w)}, gpu_s({bad_w})="
            f"{cost.gpu_s(bad_w)}, transfer_s()={x}: every time must be finite and >= 0 seconds"
        )
    loaded = tuple(e not in resident for e in experts)
    if cost.transfer_mode is TransferMode.PIPELINED:
        g = tuple(max(x, t) if miss else t for t, miss in zip(gc, loaded, strict=False))
    else:
        g = tuple(x + t if miss else t for t, miss in zip(gc, loaded, strict=False))
    return _Problem(experts, c, g, loaded, float(cost.cpu_handoff_s), x)


def _assignment(p: _Problem, on_gpu: Sequence[bool]) -> Assignment:
    """Score a placement; every solver ends here, so equal placements score bitwise equal."""
    cpu = tuple(e for e, on in zip(p.experts, on_gpu, strict=False) if not on)
    gpu = tuple(e for e, on in zip(p.experts, on_gpu, strict=False) if on)
    load = tuple(e for e, on, ld in zip(p.experts, on_gpu, p.loaded, strict=False) if on and ld)
    t_cpu = math.fsum([p.handoff] + [c for c, on in zip(p.c, on_gpu, strict=False) if not on]) if cpu else 0.0
    t_gpu = math.fsum(g for g, on in zip(p.g, on_gpu, strict=False) if on)
    return Assignment(
        cpu=cpu, gpu=gpu, load=load, t_cpu=t_cpu, t_gpu=t_gpu, t_transfer=p.transfer * len(load)
    )


def workload_from_ids(ids: np.ndarray, n_expert: int | None = None) -> dict[int, int]:
    """Tokens per expert of one ubatch's (n_tokens, k) routed ids (-1, a dropped slot, left out)."""
    flat = np.asarray(ids).reshape(-1)
    counts = np.bincount(flat[flat >= 0], minlength=n_expert or 0)
    return {int(e): int(n) for e, n in enumerate(counts) if n > 0}


def greedy_assign(workload: Mapping[int, int], resident: AbstractSet[int], cost: ExpertCosts) -> Assignment:
    """DALI's Greedy Assignment (Algorithm 1), with the hand-off H added to the CPU side.

    The active experts (w_e > 0) are visited in descending |g_e - c_e| (ties: lower expert
    id first), where c_e is the CPU time and g_e the GPU time including the copy of a
    non-resident expert. Each goes to the GPU if the GPU's running total plus g_e is <= the
    CPU's running total plus c_e (plus H for the first CPU expert), else to the CPU. One
    pass, no moves afterwards: the placement the paper evaluates (up to 92% of optimal).
    """
    p = _problem(workload, resident, cost)
    order = sorted(range(len(p.experts)), key=lambda i: -abs(p.g[i] - p.c[i]))  # stable: ids ascend
    on_gpu = [False] * len(p.experts)
    t_cpu = t_gpu = 0.0
    any_cpu = False
    for i in order:
        cpu_after = (t_cpu if any_cpu else p.handoff) + p.c[i]
        if t_gpu + p.g[i] <= cpu_after:
            on_gpu[i] = True
            t_gpu += p.g[i]
        else:
            t_cpu, any_cpu = cpu_after, True
    return _assignment(p, on_gpu)


def ratio_assign(workload: Mapping[int, int], resident: AbstractSet[int], cost: ExpertCosts) -> Assignment:
    """The best cut of the experts ordered by decreasing c_e / g_e: the first k on the GPU, the rest
    on the CPU, k = 0..n chosen for the smallest makespan. O(n log n).

    c_e / g_e is how much CPU time an expert saves per second of GPU time. The relaxation that may
    place fractions of experts is solved by filling the GPU in that order and splitting one expert;
    rounding that expert to either side gives one of the cuts tried here, so the makespan is at
    most the optimum plus min(c_e, g_e) of the split expert. Not in DALI: its Algorithm 1 visits
    experts by |g_e - c_e|, which on 32 active experts lands 11-13% above the optimum (docs/research/assignment.md).
    """
    p = _problem(workload, resident, cost)
    n = len(p.experts)
    order = sorted(
        range(n), key=lambda i: -p.c[i] / p.g[i] if p.g[i] > 0 else -math.inf
    )  # stable: ids ascend
    t_cpu = math.fsum(p.c)
    t_gpu = 0.0
    best_k, best = 0, (p.handoff + t_cpu if n else 0.0)
    for k, i in enumerate(order, start=1):  # move the k-th expert of the order to the GPU
        t_cpu -= p.c[i]
        t_gpu += p.g[i]
        span = max(p.handoff + t_cpu if k < n else 0.0, t_gpu)
        if span < best:
            best_k, best = k, span
    on_gpu = [False] * n
    for i in order[:best_k]:
        on_gpu[i] = True
    return _assignment(p, on_gpu)


def _subset_sums(values: Sequence[float]) -> np.ndarray:
    """Sum over every subset, indexed by its bit mask (bit j set: item j in the subset)."""
    sums = np.zeros(1)
    for v in values:
        sums = np.concatenate([sums, sums + v])
    return sums


def _bits(mask: int, n: int) -> list[bool]:
    return [bool(mask >> j & 1) for j in range(n)]


def optimal_assign(workload: Mapping[int, int], resident: AbstractSet[int], cost: ExpertCosts) -> Assignment:
    """The minimal makespan by brute force over all 2^n placements of the n active experts.

    For tests and evaluation; refuses n > MAX_BRUTE_FORCE_EXPERTS. Ties: the placement with
    the smallest GPU bit mask (bit j: the j-th active expert in ascending id order).
    """
    p = _problem(workload, resident, cost)
    n = len(p.experts)
    if n > MAX_BRUTE_FORCE_EXPERTS:
        raise AssignmentTooLargeError(
            f"optimal_assign enumerates 2^n placements and {n} experts are active (limit "
            f"{MAX_BRUTE_FORCE_EXPERTS}): use exact_assign (up to {MAX_EXACT_EXPERTS}) or greedy_assign"
        )
    t_gpu = _subset_sums(p.g)  # mask = the GPU set
    t_cpu = _subset_sums(p.c)[::-1] + p.handoff  # the CPU set is the complement: mask ^ full
    t_cpu[-1] = 0.0  # everything on the GPU: no hand-off
    best = int(np.argmin(np.maximum(t_cpu, t_gpu)))
    return _assignment(p, _bits(best, n))


def _pareto(cs: np.ndarray, gs: np.ndarray) -> np.ndarray:
    """Masks not dominated in (CPU time, GPU time): CPU strictly ascending, GPU strictly descending."""
    order = np.lexsort((gs, cs))
    g_sorted = gs[order]
    prev_min = np.concatenate([[np.inf], np.minimum.accumulate(g_sorted)[:-1]])
    return order[g_sorted < prev_min]


def exact_assign(workload: Mapping[int, int], resident: AbstractSet[int], cost: ExpertCosts) -> Assignment:
    """The minimal makespan by meet-in-the-middle; the same optimum as ``optimal_assign``.

    The active experts are cut into two halves; each half's 2^(n/2) placements are reduced to
    its Pareto front in (CPU time, GPU time). Along half B's front CPU time rises and GPU time
    falls, so for each point of half A the best partner is at the crossing of the two sides,
    found by binary search on (c_B - g_B). Refuses n > MAX_EXACT_EXPERTS.
    """
    p = _problem(workload, resident, cost)
    n = len(p.experts)
    if n > MAX_EXACT_EXPERTS:
        raise AssignmentTooLargeError(
            f"exact_assign enumerates 2^(n/2) placements per half and {n} experts are active "
            f"(limit {MAX_EXACT_EXPERTS}): use greedy_assign"
        )
    if n == 0:
        return _assignment(p, [])
    h = n // 2
    halves = []
    for lo, hi in ((0, h), (h, n)):
        gs = _subset_sums(p.g[lo:hi])
        cs = _subset_sums(p.c[lo:hi])[::-1]
        front = _pareto(cs, gs)
        halves.append((front, cs[front], gs[front]))
    (ma, ca, ga), (mb, cb, gb) = halves
    k = np.searchsorted(cb - gb, ga - ca - p.handoff, side="left")  # first B point where CPU >= GPU
    best_val, best_mask = math.inf, 0
    for j in (np.clip(k - 1, 0, len(mb) - 1), np.clip(k, 0, len(mb) - 1)):
        vals = np.maximum(p.handoff + ca + cb[j], ga + gb[j])
        i = int(np.argmin(vals))
        if vals[i] < best_val:
            best_val, best_mask = float(vals[i]), int(ma[i]) | int(mb[j[i]]) << h
    # the all-GPU placement pays no hand-off, which the search above charged it
    if p.handoff > 0 and math.fsum(p.g) <= best_val:
        best_mask = (1 << n) - 1
    return _assignment(p, _bits(best_mask, n))


class MissAction(str, enum.Enum):
    """What to do with an expert a decode step needs that is not resident."""

    CPU = "cpu"  # compute it on the CPU now, from host memory
    WAIT = "wait"  # copy it to the GPU, then compute it there
    SPLIT = "split"  # both: the CPU computes part of its rows while the GPU copies and computes the rest


def split_share(cpu_s: float, wait_s: float, handoff_s: float, gpu_busy_s: float = 0.0) -> float:
    """The CPU's share f of rows in a split of expert work that takes cpu_s on the CPU (plus the hand-off
    handoff_s) and wait_s copied to and computed on the GPU, both scaling with their share of the rows, the
    GPU having gpu_busy_s of other work of the layer first: handoff_s + f*cpu_s = gpu_busy_s + (1-f)*wait_s.
    Outside (0, 1) the split degenerates to one side."""
    return (wait_s + gpu_busy_s - handoff_s) / (cpu_s + wait_s) if cpu_s + wait_s > 0 else 0.0


def decode_miss_costs(tokens: int, cost: ExpertCosts) -> dict[MissAction, float]:
    """The time of each MissAction for one non-resident expert routed `tokens` tokens (seconds).

    cpu:   H + cpu_s(n)
    wait:  transfer_s() + gpu_s(n)  (one expert: its compute needs its whole copy)
    split: the expert's FFN rows (gate/up rows with the matching down columns) are cut: the
           CPU computes a fraction f from host memory while the GPU copies and computes the
           rest, and the two partial outputs are added. Assuming both sides scale with their
           share of the rows (true for memory-bound decode), f balances H + f*cpu = (1-f)*wait:
           f = (wait - H) / (cpu + wait), time H + f*cpu + split_overhead_s. When f is not in
           (0, 1), splitting degenerates to one side and its time is infinite.
    """
    if tokens < 1:
        raise AssignmentError(f"a decode miss needs >= 1 routed token, got {tokens}")
    cpu, gpu, x, hand = (
        float(cost.cpu_s(tokens)),
        float(cost.gpu_s(tokens)),
        float(cost.transfer_s()),
        float(cost.cpu_handoff_s),
    )
    t_cpu, t_wait = hand + cpu, x + gpu
    f = split_share(cpu, t_wait, hand)
    t_split = hand + f * cpu + float(cost.split_overhead_s) if 0.0 < f < 1.0 else math.inf
    return {MissAction.CPU: t_cpu, MissAction.WAIT: t_wait, MissAction.SPLIT: t_split}


def decode_miss_choice(tokens: int, cost: ExpertCosts) -> MissAction:
    """The fastest MissAction by ``decode_miss_costs``; ties go to cpu, then wait (no copy, one side)."""
    costs = decode_miss_costs(tokens, cost)
    return min(costs, key=lambda a: costs[a])  # dict order cpu, wait, split: min keeps the first


class AssignerKind(str, enum.Enum):
    GREEDY = "greedy"  # DALI's Algorithm 1
    RATIO = "ratio"  # best cut in CPU/GPU time-ratio order
    EXACT = "exact"  # meet-in-the-middle optimum (evaluation; milliseconds at 32 experts)
    BRUTE_FORCE = "brute-force"  # 2^n optimum (tests)


Assigner = Callable[[Mapping[int, int], AbstractSet[int], ExpertCosts], Assignment]
_ASSIGNERS: dict[AssignerKind, Assigner] = {
    AssignerKind.GREEDY: greedy_assign,
    AssignerKind.RATIO: ratio_assign,
    AssignerKind.EXACT: exact_assign,
    AssignerKind.BRUTE_FORCE: optimal_assign,
}


# the records that take an assigner (lru's, dali's: edgemoe.policies.kinds) refuse it where it cannot act
ASSIGN_REFUSAL = (
    "`assign` is an option of `policy='lru'` or dali without `blocking` or `dali_prefetch` (it "
    "decides which of their misses to load before the layer runs)"
)


def assign_refusal(*, blocking: bool, prefetcher: bool) -> str | None:
    """Why a CPU/GPU assigner cannot act on a residency policy that takes one (None: it can): it decides which
    misses load now, so not with blocking loads or a prefetcher. The one statement of the rule, for the config
    records and edgemoe.placement's request check."""
    return None if not blocking and not prefetcher else ASSIGN_REFUSAL


def make_assigner(kind: str) -> Assigner:
    """The assignment function named `kind` (an AssignerKind value)."""
    try:
        return _ASSIGNERS[AssignerKind(kind)]
    except ValueError:
        raise AssignmentError(
            f"unknown assigner {kind!r}: use one of {', '.join(k.value for k in AssignerKind)}"
        ) from None
