"""Running a residency or prefetch policy route by route over the cache model, with copy timing; counters.

`PolicyDriver` is shared by the offline `replay` and the engine (edgemoe.runtime.prefetcher): at
each MoE layer's routing it (1) scores the prediction made for this layer, (2) counts hits and
misses against what is resident, (3) lets the policy act, (4) for a blocking policy waits for the
routed experts still loading and counts then, (5) issues the chunks the copy stream moves while the
layer computes (`CopyStream`), and returns the native operations that do the same on llama.cpp.
lru, dali and static (edgemoe.policies.residency) run through it too: their loads are queued after
the layer's experts were mapped (speculative priority), or before them at the precise priority and
waited for when blocking. With an infinite bandwidth its counters are `replay_policy`'s.

Counters (over the counted steps, e.g. decode tokens):

- hit rate: routed expert slots of cached layers whose expert was resident when the layer ran;
- loads per token: loads that completed (became resident); bytes per token: chunk bytes sent over
  PCIe (those of loads dropped half-way included);
- useful share: completed loads whose expert then served at least one hit before it left;
- prefetch (promoe): ``issued`` speculative loads queued for a prediction, ``useful`` those complete
  when their layer routed whose expert it used, ``preempted`` those dropped before completing;
- GoodPred (ProMoE §4.1, Accuracy x FetchRate), per prediction of layer t from layer t-d with P the
  predicted experts (top-(k+m)) and A the experts layer t then used: Accuracy = sum |P & A| / sum |A|
  (the share of used experts that were predicted), FetchRate = sum |P resident when layer t routes|
  / sum |P| (the share of predicted experts in the cache in time, prefetched or already there),
  GoodPred = Accuracy x FetchRate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .copy_queue import CacheModel, CopyStream, CopyTiming, NativeOp, Priority
from .counters import PrefetchCounts as PrefetchCounts  # re-exported: they lived here
from .counters import ReplayResult as ReplayResult
from .loads import Residency
from .prefetching import Prediction, Prefetcher
from .residency import Load, used_experts

AnyPolicy = Residency | Prefetcher


class PolicyDriver:
    """One policy over one cache model and copy stream; call begin_step, then on_route per MoE layer."""

    def __init__(self, policy: AnyPolicy, model: CacheModel, timing: CopyTiming | None = None) -> None:
        self.policy = policy
        self.model = model
        self.stream = CopyStream(timing or CopyTiming())
        self.result = ReplayResult(prefetch=PrefetchCounts() if isinstance(policy, Prefetcher) else None)
        self._counted = True
        for ld in policy.initial_loads():
            model.load(ld)
        self._collect()

    def begin_step(self, n_tokens: int, counted: bool = True) -> None:
        """A new ubatch (or decode token) of n_tokens; counted: its events go into the result."""
        self._counted = counted
        self.model.counting = counted
        if counted:
            self.result.tokens += n_tokens

    def on_route(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None = None) -> list[NativeOp]:
        """MoE layer `layer` routed `ids` (router input `hidden`): act; returns the native operations."""
        ids = np.asarray(ids)
        pol, model = self.policy, self.model
        if isinstance(pol, Prefetcher):  # the family's protocol, not a policy's class
            pred = pol.take_prediction(layer)
            if pred is not None:
                self._score(pred, ids)
        if not pol.blocking:
            self._count_hits(layer, ids)
        if isinstance(pol, Prefetcher):
            pol.on_route(layer, ids, hidden, model)
        else:
            prio = Priority.PRECISE if pol.blocking else Priority.SPECULATIVE
            for ld in pol.on_route(layer, ids):
                self._move(ld)
                model.prefetch(ld, prio)
        if pol.blocking:
            used = set(used_experts(ids))
            waiting = [r for r in model.pending(layer) if r.expert in used]
            if waiting:
                stall = self.stream.wait(model, waiting)
                model.sync()
                if self._counted:
                    self.result.stall_s += stall
            self._count_hits(layer, ids)
        self.stream.interval(model, int(ids.shape[0]))
        self._collect()
        return model.take_ops()

    def _move(self, ld: Load) -> None:
        """An expert a residency policy loads into another slot leaves its old one first (as `replay_policy`
        and the native LRU do: a ubatch with more misses than slots can evict its own hit and load it back)."""
        old = self.model.resident(ld.layer).get(ld.expert)
        req = self.model.request(ld.layer, ld.expert)
        for slot in ([old.slot] if old is not None else []) + ([req.slot] if req is not None else []):
            if slot != ld.slot:
                self.model.cancel(ld.layer, slot)

    def _count_hits(self, layer: int, ids: np.ndarray) -> None:
        if self.model.n_slots.get(layer, 0) <= 0:
            return
        flat = ids.reshape(-1)
        flat = flat[flat >= 0]
        resident = self.model.resident(layer)
        hit = np.fromiter((int(e) in resident for e in flat), bool, flat.size)
        if self._counted:
            self.result.hits += int(hit.sum())
            self.result.misses += int((~hit).sum())
        for e in set(int(x) for x in flat[hit]):
            r = resident[e]
            if not r.used:
                r.used = True
                self.result.useful_loads += int(r.counted)

    def _score(self, pred: Prediction, ids: np.ndarray) -> None:
        pc = self.result.prefetch
        if pc is None or not self._counted:
            return
        used = set(used_experts(ids))
        resident = self.model.resident(pred.target)
        in_time = [e for e in pred.experts if e in resident]
        pc.predicted += len(pred.experts)
        pc.in_time += len(in_time)
        pc.routed += len(used)
        pc.correct += len(used & set(pred.experts))
        pc.useful += sum(1 for e in in_time if e in used and resident[e].tag is pred)

    def _collect(self) -> None:
        queued, completed, dropped, nbytes = self.model.take_events()
        if not self._counted:
            return
        res = self.result
        res.loads += len(completed)
        res.bytes += nbytes
        if res.prefetch is not None:
            res.prefetch.issued += sum(isinstance(r.tag, Prediction) for r in queued)
            res.prefetch.preempted += sum(isinstance(r.tag, Prediction) for r in dropped)


Route = tuple[int, np.ndarray] | tuple[int, np.ndarray, np.ndarray | None]  # (layer, ids[, router input])


def replay(
    policy: AnyPolicy,
    steps: Iterable[Sequence[Route]],
    *,
    timing: CopyTiming | None = None,
    chunk_bytes: Mapping[int, Sequence[int]] | None = None,
    counted: Iterable[bool] | None = None,
) -> ReplayResult:
    """Replay steps (each a list of routes in layer order: (layer, ids) or (layer, ids, router input))
    as the engine runs them, with the copy `timing` (default: infinite bandwidth) and the chunk bytes
    of each layer's experts (ExpertCache.chunk_bytes / expert_chunk_bytes; default three 1-byte chunks).
    `counted`: one flag per step; the other steps change the cache but are not counted."""
    driver = PolicyDriver(policy, CacheModel(policy.n_slots, chunk_bytes), timing)
    flags = iter(counted) if counted is not None else None
    for step in steps:
        count = True if flags is None else bool(next(flags))
        if not step:
            continue
        driver.begin_step(max(int(np.asarray(r[1]).shape[0]) for r in step), count)
        for route in step:
            driver.on_route(route[0], route[1], route[2] if len(route) > 2 else None)  # type: ignore[misc]
    return driver.result
