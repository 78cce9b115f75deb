"""How many expert-cache slots each MoE layer gets: AdapMoE's DP allocation over replayed costs.

AdapMoE (Zhong et al., §4.4) gives layer i t_i slots so that the expected on-demand loads
sum_i f_i(t_i) are smallest under a total budget sum_i t_i <= T (eq. 16-18), a knapsack solved by
dynamic programming over layers (eq. 19). Its f_i(t) is a closed form for Mixtral's top-2 (eq.
10-15): a routed expert hits with probability t/N, independently of the last token, a share α_i
of tokens keeps one expert and a prefetcher guesses right with probability β_i.

We measure f_i(t) instead: layer i's routes from a recorded trace are replayed through the
residency policy the engine will run (edgemoe.policies.residency), once per t = 0..N, and
f_i(t) is the misses per token: routed expert slots whose expert is not resident when the step
starts (the experts the CPU computes; with blocking loads, the loads made on demand). Why not the
closed form: our models route top-4 or top-8, adaptive gating keeps any number of experts
(not one or two), and t/N is the hit rate of a random cache: LRU or DALI on real routes hits far
more often where a layer's routing is skewed or repeats from token to token, and how much more
differs from layer to layer, which is exactly what the allocation should exploit. The replay is
also what the engine's counters report (the same policy code), so a DP allocation can be checked
against equal allocation on held-out text with the same replay.

AdapMoE's two parameters still apply where the trace does not already hold them:

- α_i (``alpha``): the share of layer i's tokens that keep one expert under the gating to be run.
  A trace recorded with that gating already holds its drops (leave alpha None); for a trace
  recorded at full top-k, the replay keeps only the first id (llama.cpp orders the selected ids by
  router score, highest first) of a seeded random α_i share of the layer's tokens.
- β_i (``beta``): the share of missed experts a prefetcher has already brought in: f_i(t) is
  multiplied by 1 - β_i (AdapMoE's eq. 11-14 for one prefetched expert per token; here each missed
  expert is prefetched with probability β_i). No prefetcher drives loads yet, so the default is 0.

Everything is numpy over per-layer step lists ((n_tokens, k) id arrays, -1 for a dropped slot):
`layer_steps` cuts a trace's arrays into the ubatches the engine ran (`decode_steps` flags the
decode tokens, the steps a DP for decoding counts), `replay_curve` replays one
layer for every t (exact fast paths for lru and static, `replay_policy` per t for the others),
`f_curves` builds the DP's input, `dp_allocate` and `equal_allocate` split a budget.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from ..errors import EdgeMoeError, InvalidConfigError
from .registry import LayerReplay, PolicyInputs, PolicyRecord, PolicySpec, policy_config, policy_spec
from .residency import DALI_WINDOW, replay_policy, used_experts

DECODE = 1  # edgemoe.analysis.trace.DECODE: a token fed alone, one step
MAX_UNITS = 1 << 16  # knapsack capacity above which byte weights are coarsened (rounded up)


class AllocationError(EdgeMoeError):
    """The cache budget cannot be split as asked."""


# -- traces to steps ------------------------------------------------------------------------------
def _step_bounds(phase: np.ndarray, seq: np.ndarray, ubatch: int) -> list[int]:
    if ubatch < 1:
        raise EdgeMoeError(f"ubatch {ubatch}: must be >= 1")
    bounds = [0]
    run = 0  # tokens in the current prefill ubatch
    for i in range(1, len(phase)):
        new = seq[i] != seq[i - 1] or phase[i] != phase[i - 1] or phase[i] == DECODE or run + 1 >= ubatch
        run = 0 if new else run + 1
        if new:
            bounds.append(i)
    return bounds + [len(phase)]


def layer_steps(
    ids: np.ndarray, layers: Sequence[int], phase: np.ndarray, seq: np.ndarray, *, ubatch: int
) -> dict[int, list[np.ndarray]]:
    """Each MoE layer's routes in the steps the engine ran: prefill runs of a sequence cut into
    ubatches of `ubatch` tokens, every decode token a step of its own.

    ids (T, L, k), phase (T,) (0 prefill, 1 decode), seq (T,): a trace's arrays (docs/traces.md).
    """
    ids = np.asarray(ids)
    if ids.ndim != 3 or ids.shape[1] != len(layers) or ids.shape[0] != len(phase):
        raise EdgeMoeError(
            f"routing ids of shape {ids.shape}: expected ({len(phase)} tokens, {len(layers)} layers, k)"
        )
    bounds = _step_bounds(phase, seq, ubatch)
    return {int(il): [ids[a:b, j] for a, b in pairwise(bounds) if b > a] for j, il in enumerate(layers)}


def decode_steps(phase: np.ndarray, seq: np.ndarray, *, ubatch: int) -> np.ndarray:
    """(n_steps,) bool: which of layer_steps' steps are decode tokens."""
    bounds = _step_bounds(phase, seq, ubatch)
    return np.array([phase[a] == DECODE for a, b in pairwise(bounds) if b > a], bool)


def steps_of(steps_by_layer: Mapping[int, Sequence[np.ndarray]]) -> list[list[tuple[int, np.ndarray]]]:
    """The per-layer step lists as `replay_policy`'s steps ([(layer, ids), ...] in layer order)."""
    layers = sorted(steps_by_layer)
    n = {len(steps_by_layer[il]) for il in layers}
    if len(n) > 1:
        raise EdgeMoeError(f"layers have different step counts {sorted(n)}: not one trace")
    return [[(il, steps_by_layer[il][s]) for il in layers] for s in range(n.pop() if n else 0)]


def keep_top1(steps: Sequence[np.ndarray], alpha: float, *, seed: int = 0) -> list[np.ndarray]:
    """A seeded random `alpha` share of the tokens keep only their first (highest-scored) expert."""
    if not 0.0 <= alpha <= 1.0:
        raise EdgeMoeError(f"alpha {alpha}: a share of tokens, 0..1")
    rng = np.random.default_rng(seed)
    out = []
    for ids in steps:
        ids = np.array(ids, copy=True)
        one = rng.random(ids.shape[0]) < alpha
        ids[one, 1:] = -1
        out.append(ids)
    return out


# -- replay ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MissCurve:
    """One layer's replay for every slot count t = 0..max_slots (counts over the counted steps)."""

    misses: np.ndarray  # (max_slots + 1,) routed expert slots not resident when their step started
    loads: np.ndarray  # (max_slots + 1,) experts copied into the layer's slots
    routed: int  # routed expert slots (dropped ones left out)
    tokens: int


def replay_curve(
    steps: Sequence[np.ndarray],
    kind: str,
    max_slots: int,
    *,
    n_expert: int,
    frequency: np.ndarray | None = None,
    window: int = DALI_WINDOW,
    update: int | None = None,
    counted: Sequence[bool] | np.ndarray | None = None,
    fast: bool = True,
) -> MissCurve:
    """Replay one layer's steps through policy `kind` (non-blocking) with t = 0..max_slots slots.

    counted: one flag per step; only those steps' misses, loads, routed slots and tokens count
    (e.g. decode_steps: the others still change the residency).

    The counters are `replay_policy`'s for a policy with t slots in this layer (misses at t = 0: every
    routed slot). lru, dali, static and daop have exact vectorised replays (``fast``); without it (and
    for other policies) `replay_policy` runs once per t. static and daop need the layer's `frequency`
    (n_expert,): static places by it, daop starts from it (the calibration's decode-phase counts).
    """
    spec = _spec(kind)
    if not 0 <= max_slots <= n_expert:
        raise AllocationError(f"max_slots {max_slots}: use 0..{n_expert} (the layer's experts)")
    steps = [np.asarray(s) for s in steps]
    flags = np.ones(len(steps), bool) if counted is None else np.asarray(counted, bool)
    if flags.shape != (len(steps),):
        raise AllocationError(f"{flags.shape[0]} counted flags for {len(steps)} steps")
    routed = sum(int((s >= 0).sum()) for s, c in zip(steps, flags, strict=False) if c)
    tokens = sum(int(s.shape[0]) for s, c in zip(steps, flags, strict=False) if c)
    if not spec.replayable:
        raise AllocationError(f"the {kind} policy loads nothing by itself: there is nothing to replay")
    if spec.frequency_phase is not None and frequency is None:
        raise AllocationError(f"the {kind} policy's replay needs the layer's router frequency")
    config = replay_config(kind, window=window, update=update)
    freq = None if frequency is None else np.asarray(frequency)
    if fast and spec.all_sizes is not None:
        misses, loads = spec.all_sizes(config, LayerReplay(steps, flags, max_slots, n_expert, freq))
    else:
        misses = np.zeros(max_slots + 1, np.int64)
        loads = np.zeros(max_slots + 1, np.int64)
        for t in range(1, max_slots + 1):
            placed = None if freq is None else {0: freq}
            pol = spec.build(config, PolicyInputs({0: t}, n_expert, placed))
            res = replay_policy(pol, ([(0, s)] for s in steps), flags)
            misses[t], loads[t] = res.misses, res.loads
    misses[0], loads[0] = routed, 0
    return MissCurve(misses=misses, loads=loads, routed=routed, tokens=tokens)


def _spec(kind: str) -> PolicySpec:
    try:
        return policy_spec(kind)
    except InvalidConfigError as err:
        raise AllocationError(str(err)) from None


def replay_config(kind: str, *, window: int = DALI_WINDOW, update: int | None = None) -> PolicyRecord:
    """The record of policy `kind` that the replays run: its defaults, with the replay's window / update where the
    policy has them (dali)."""
    has = _spec(kind).option_names
    given = {"window": window, "update": update}
    return policy_config(kind, **{k: v for k, v in given.items() if k in has})


def _step_counts(steps: Sequence[np.ndarray], n_expert: int) -> list[tuple[np.ndarray, list[int]]]:
    out = []
    for s in steps:
        flat = s.reshape(-1)
        out.append((np.bincount(flat[flat >= 0], minlength=n_expert), used_experts(s)))
    return out


def lru_all_sizes(
    steps: Sequence[np.ndarray], flags: np.ndarray, max_slots: int, n_expert: int
) -> tuple[np.ndarray, np.ndarray]:
    """LruPolicy for every size at once. Row t holds the t most recently touched experts, a step
    touching its hits (first-use order), then its misses (first-use order): exact while a step uses
    at most t experts (no hit is evicted then). Rows with fewer slots than the step uses experts
    run LruPolicy's own steps instead (its misses may evict this step's hits, which come back when
    their turn comes)."""
    sizes = np.arange(max_slots + 1)[:, None]
    rows = np.arange(max_slots + 1)[:, None]
    last = np.full((max_slots + 1, n_expert), -1, np.int64)  # touch stamp, -1: never used (or evicted)
    res = np.zeros((max_slots + 1, n_expert), bool)
    rank = np.empty_like(last)
    misses = np.zeros(max_slots + 1, np.int64)
    loads = np.zeros(max_slots + 1, np.int64)
    clock = 0
    for (counts, used), count in zip(_step_counts(steps, n_expert), flags, strict=False):
        if not used:
            continue
        u = np.array(used)
        m = len(used)
        if count:
            misses += int(counts.sum()) - res @ counts
        small = {
            t: _lru_step([int(e) for e in np.flatnonzero(res[t])[np.argsort(last[t, res[t]])]], used, t)
            for t in range(1, min(m, max_slots + 1))
        }
        hit = res[:, u]
        last[:, u] = clock + np.arange(m) + np.where(hit, 0, m)
        order = np.argsort(-last, axis=1, kind="stable")
        rank[rows, order] = np.arange(n_expert)
        new = (rank < sizes) & (last >= 0)
        step_loads = (new & ~res).sum(1)
        for t, (keep, n_loads) in small.items():
            last[t] = -1
            last[t, keep] = clock + np.arange(len(keep))
            new[t] = False
            new[t, keep] = True
            step_loads[t] = n_loads
        clock += 2 * m
        if count:
            loads += step_loads
        res = new
    return misses, loads


def _lru_step(lru_first: list[int], used: list[int], n: int) -> tuple[list[int], int]:
    """LruPolicy.on_route with n slots: the resident experts afterwards (LRU first) and the loads.

    A slot is labelled by the expert it held before the step (free ones by negative numbers): an
    expert evicted by this step's misses and then inserted again is a load unless it gets its own
    slot back, as LruPolicy's loads are the experts whose slot changed.
    """
    lru = OrderedDict((e, e) for e in lru_first)  # expert -> label of its slot
    free = iter(range(-1, -n - 1, -1))
    for e in used:
        if e in lru:
            lru.move_to_end(e)
    for e in used:
        if e in lru:
            continue
        lru[e] = next(free) if len(lru) < n else lru.popitem(last=False)[1]
    return list(lru), sum(1 for e, label in lru.items() if label != e)


def dali_all_sizes(
    steps: Sequence[np.ndarray], flags: np.ndarray, max_slots: int, n_expert: int, window: int, update: int
) -> tuple[np.ndarray, np.ndarray]:
    """DaliPolicy for every size at once: the scores and the window are the same in every row, only
    the resident sets differ."""
    rows = np.arange(max_slots + 1)[:, None]
    sizes = np.arange(max_slots + 1)
    res = np.zeros((max_slots + 1, n_expert), bool)
    scores = np.zeros(n_expert, np.int64)
    misses = np.zeros(max_slots + 1, np.int64)
    loads = np.zeros(max_slots + 1, np.int64)
    tokens = 0
    ids_asc = np.arange(n_expert)
    for s, (counts, used), count in zip(steps, _step_counts(steps, n_expert), flags, strict=False):
        if count:
            misses += int(counts.sum()) - res @ counts
        scores += counts
        if used:  # warm-up fills: the step's misses by routed tokens, then first use
            cand = np.array(sorted(used, key=lambda e: (-counts[e], used.index(e))))
            absent = ~res[:, cand]
            take = absent & (np.cumsum(absent, axis=1) <= (sizes - res.sum(1))[:, None])
            res[:, cand] |= take
            loads += take.sum(1) * count
        tokens += int(s.shape[0])
        if tokens < window:
            continue
        down = np.argsort(-scores, kind="stable")  # incoming: highest score first, ties lower id
        up = np.lexsort((ids_asc, scores))  # outgoing: lowest score first, ties lower id
        e_in, ok_in = _first_true(~res[:, down], update)
        e_out, ok_out = _first_true(res[:, up], update)
        e_in, e_out = down[e_in], up[e_out]
        ok = np.cumprod(ok_in & ok_out & (scores[e_in] > scores[e_out]), axis=1).astype(bool)
        res[np.broadcast_to(rows, ok.shape)[ok], e_in[ok]] = True
        res[np.broadcast_to(rows, ok.shape)[ok], e_out[ok]] = False
        loads += ok.sum(1) * count
        scores[:] = 0
        tokens = 0
    res[0] = False
    return misses, loads


def _first_true(mask: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the column indices of the first n True values (n, padded) and which of them exist."""
    idx = np.argsort(~mask, axis=1, kind="stable")[:, :n]
    return idx, np.take_along_axis(mask, idx, axis=1)


def static_all_sizes(
    steps: Sequence[np.ndarray], flags: np.ndarray, max_slots: int, n_expert: int, frequency: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """StaticPolicy for every size: the top-t experts by frequency (ties: lower id), loaded once."""
    total = np.zeros(n_expert, np.int64)
    for (counts, _), count in zip(_step_counts(steps, n_expert), flags, strict=False):
        if count:
            total += counts
    top = np.argsort(-np.asarray(frequency, np.float64), kind="stable")
    served = np.concatenate([[0], np.cumsum(total[top])])[: max_slots + 1]
    return total.sum() - served, np.arange(max_slots + 1, dtype=np.int64)


def f_curves(
    steps_by_layer: Mapping[int, Sequence[np.ndarray]],
    policy_kind: str,
    max_slots: int,
    *,
    n_expert: int,
    measure: str = "misses",
    alpha: Mapping[int, float] | None = None,
    beta: Mapping[int, float] | None = None,
    frequency: Mapping[int, np.ndarray] | None = None,
    window: int = DALI_WINDOW,
    update: int | None = None,
    counted: Sequence[bool] | np.ndarray | None = None,
    seed: int = 0,
) -> dict[int, np.ndarray]:
    """AdapMoE's f_i(t) per layer for t = 0..max_slots: misses (or loads) per token of the replay.

    alpha: per layer, the share of tokens that keep one expert (applied to a full top-k trace);
    beta: per layer, the prefetch accuracy (f_i scaled by 1 - beta_i). See the module docstring.
    counted: one flag per step, the steps whose tokens count (decode_steps: per decode token).
    """
    if measure not in ("misses", "loads"):
        raise AllocationError(f"unknown measure {measure!r}: use misses or loads")
    out = {}
    for il, steps in steps_by_layer.items():
        if alpha is not None and alpha.get(il, 0.0) > 0.0:
            steps = keep_top1(steps, alpha[il], seed=seed + il)
        c = replay_curve(
            steps,
            policy_kind,
            max_slots,
            n_expert=n_expert,
            frequency=None if frequency is None else frequency[il],
            window=window,
            update=update,
            counted=counted,
        )
        f = (c.misses if measure == "misses" else c.loads) / max(c.tokens, 1)
        out[il] = f * (1.0 - (beta or {}).get(il, 0.0))
    return out


# -- allocation -----------------------------------------------------------------------------------
def equal_allocate(layers: Sequence[int], budget_slots: int, *, max_slots: int) -> dict[int, int]:
    """budget_slots split as evenly as possible (the first layers get the remainder), at most
    max_slots each."""
    if budget_slots < 0:
        raise AllocationError(f"a budget of {budget_slots} slots: must be >= 0")
    layers = sorted(layers)
    if not layers:
        return {}
    q, r = divmod(budget_slots, len(layers))
    return {il: min(max_slots, q + (1 if i < r else 0)) for i, il in enumerate(layers)}


def _units(weights: Mapping[int, int], budget: int) -> tuple[dict[int, int], int]:
    """Integer knapsack weights and capacity: the weights' gcd as the unit, coarser (weights rounded
    up, so the budget still holds) when the capacity would exceed MAX_UNITS."""
    if any(w <= 0 for w in weights.values()):
        raise AllocationError(f"bytes per expert must be > 0, got {dict(weights)}")
    unit = math.gcd(*weights.values())
    if budget // unit > MAX_UNITS:
        unit = max(unit, -(-budget // MAX_UNITS))
    return {il: -(-w // unit) for il, w in weights.items()}, budget // unit


def dp_allocate(
    curves: Mapping[int, np.ndarray],
    budget: int,
    *,
    bytes_per_expert: Mapping[int, int] | None = None,
    min_slots: int = 0,
    max_total: int | None = None,
) -> dict[int, int]:
    """Slots per layer minimising sum_i curves[i][t_i] (AdapMoE eq. 16-19).

    budget: total slots (sum t_i <= budget), or with `bytes_per_expert` a byte budget
    (sum t_i * bytes_per_expert[i] <= budget). Each t_i is in min_slots..len(curves[i]) - 1.
    Among allocations of equal cost (to 1e-9 of the largest value), the one closest to equal
    allocation (least squared distance) wins, so identical curves give equal allocation.

    max_total (with bytes_per_expert): the slots asked, which DP redistributes and never adds to.
    Where layers' experts differ in bytes, the byte optimum may hold more slots than asked (more
    in the cheaper layers). Then the slot optimum is taken if it fits the bytes (exact: it is the
    optimum of the looser problem), else the byte optimum less the slots whose removal costs least,
    one at a time (greedy, not a proven optimum).
    """
    if bytes_per_expert is not None and max_total is not None:
        return _dp_bytes_and_slots(curves, budget, bytes_per_expert, min_slots, max_total)
    layers = sorted(curves)
    if not layers:
        return {}
    if budget < 0:
        raise AllocationError(f"a budget of {budget}: must be >= 0")
    f = {il: np.asarray(curves[il], np.float64) for il in layers}
    if bytes_per_expert is None:
        w, cap = {il: 1 for il in layers}, budget
        target = equal_allocate(layers, budget, max_slots=max(len(c) - 1 for c in f.values()))
    else:
        missing = sorted(set(layers) - set(bytes_per_expert))
        if missing:
            raise AllocationError(f"no bytes per expert for layers {missing}")
        w, cap = _units({il: int(bytes_per_expert[il]) for il in layers}, budget)
        each = budget / sum(bytes_per_expert[il] for il in layers)
        target = {il: each for il in layers}
    floor = sum(min_slots * w[il] for il in layers)
    if any(min_slots > len(f[il]) - 1 for il in layers) or floor > cap:
        raise AllocationError(
            f"min_slots {min_slots} in each of {len(layers)} layers does not fit the "
            f"budget ({budget}{' bytes' if bytes_per_expert is not None else ' slots'})"
        )
    tol = 1e-9 * max(1.0, max(float(np.abs(c).max()) for c in f.values()))
    cost = np.zeros(cap + 1)  # F[i][j]: best cost of the layers so far within j units
    dev = np.zeros(cap + 1)  # tie-break: squared distance to the equal allocation
    choice = np.zeros((len(layers), cap + 1), np.int64)
    for i, il in enumerate(layers):
        new_cost = np.full(cap + 1, np.inf)
        new_dev = np.full(cap + 1, np.inf)
        for t in range(min_slots, len(f[il])):
            used = t * w[il]
            if used > cap:
                break
            c = np.full(cap + 1, np.inf)
            d = np.full(cap + 1, np.inf)
            c[used:] = cost[: cap + 1 - used] + f[il][t]
            d[used:] = dev[: cap + 1 - used] + (t - target[il]) ** 2
            better = (c < new_cost - tol) | ((c <= new_cost + tol) & (d < new_dev))
            new_cost = np.where(better, c, new_cost)
            new_dev = np.where(better, d, new_dev)
            choice[i, better] = t
        cost, dev = new_cost, new_dev
    out: dict[int, int] = {}
    j = cap
    for i in range(len(layers) - 1, -1, -1):
        t = int(choice[i, j])
        out[layers[i]] = t
        j -= t * w[layers[i]]
    if bytes_per_expert is not None:  # coarsened weights may leave bytes a slot still fits in
        _top_up(out, f, {il: int(bytes_per_expert[il]) for il in layers}, budget, tol)
    return dict(sorted(out.items()))


def _dp_bytes_and_slots(
    curves: Mapping[int, np.ndarray], budget: int, nbytes: Mapping[int, int], min_slots: int, max_total: int
) -> dict[int, int]:
    """dp_allocate under both a byte budget and at most max_total slots (see dp_allocate)."""
    by_bytes = dp_allocate(curves, budget, bytes_per_expert=nbytes, min_slots=min_slots)
    if sum(by_bytes.values()) <= max_total:
        return by_bytes
    by_slots = dp_allocate(curves, max_total, min_slots=min_slots)
    if sum(t * nbytes[il] for il, t in by_slots.items()) <= budget:
        return by_slots
    f = {il: np.asarray(curves[il], np.float64) for il in curves}
    out = dict(by_bytes)
    while sum(out.values()) > max_total:
        il = min(
            (il for il, t in out.items() if t > min_slots), key=lambda il: f[il][out[il] - 1] - f[il][out[il]]
        )
        out[il] -= 1
    return out


def _top_up(
    slots: dict[int, int], f: Mapping[int, np.ndarray], nbytes: Mapping[int, int], budget: int, tol: float
) -> None:
    """Add slots, the largest cost decrease first, while they fit in the bytes left."""
    left = budget - sum(slots[il] * nbytes[il] for il in slots)
    while True:
        gains = {
            il: f[il][t] - f[il][t + 1]
            for il, t in slots.items()
            if t + 1 < len(f[il]) and nbytes[il] <= left
        }
        best = max(gains, key=lambda il: gains[il], default=None)
        if best is None or gains[best] <= tol:
            return
        slots[best] += 1
        left -= nbytes[best]


def total_cost(curves: Mapping[int, np.ndarray], slots: Mapping[int, int]) -> float:
    """sum_i curves[i][slots[i]]."""
    return float(sum(np.asarray(curves[il])[slots[il]] for il in curves))
