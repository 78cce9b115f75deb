"""ProMoE's proactive expert cache (Song et al., §4-5, Algorithms 1-2) as a policy over the cache model.

At MoE layer l of each ubatch, once its routing and its router input h_l are known:

1. **Precise experts of layer l** (PushPreciseExperts, with early preemption, §5.2): speculative
   loads of layer l still queued or copying that the router did not choose are dropped; chosen
   experts whose load is incomplete are raised to the precise priority (llama.cpp's queue cannot
   raise a queued load, so it is dropped and queued again, and chunks already copied are copied
   again). Chosen experts that are absent: with `blocking` they are queued at the precise priority
   and the layer waits for them (edgemoe.policies.replay.PolicyDriver does the waiting), as ProMoE
   does; without (the default) they run on the CPU this time and are queued for the layer's next run
   at the lowest priority (REFILL: the LRU cache's own loads, §6.1), behind every prediction.
2. **Stride prediction** (PushPredictedExperts, §4.4): the predictor scores the experts of layer
   l+d (d = the predictor's distance, ProMoE's 2) from h_l; the top-(k+m) (m = `extra`) are queued as
   speculative loads in score order, each copied chunk by chunk (§5.1); those already resident are
   touched (their recency renewed, Alg. 2 line 4), those already queued are left.

Admission (with a `timing`, edgemoe.policies.copy_queue.CopyTiming): a speculative load is queued
only if the bytes queued ahead of it and its own can cross the link in the d layer times before its
layer routes, and a refill only if they can within the current layer's time; llama.cpp's prefetch
evicts the slot's expert when the load is queued, so a load that cannot arrive in time costs a
resident expert for nothing. On the fixtures' held-out text at a laptop's PCIe bandwidth this takes
promoe's decode hit rate at E/4 slots from 0.08-0.39 to 0.56-0.62, above lru and static
(docs/research/prefetch.md); without a timing (an unknown or infinite bandwidth) everything is queued.

Replacement (§6.1: a per-layer LRU): a load takes a free slot, else the least recently used slot
(touched when routed or predicted) whose expert is not pinned and has no load queued. Pinned are
the experts routed for the layer (so a hit is never evicted before its layer runs) and, for a
speculative load, the experts predicted with it.

Not modelled: reordered inference (§5.3; llama.cpp runs a layer's experts in one mul_mat_id, and a
missed expert runs on the CPU, not after its copy), the predictor's own latency (§4.4: it runs
beside the layers), prediction of the first d MoE layers (the mlp and gate predictors predict
within a token; those layers are cached as LRU does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import EdgeMoeError
from ..predictors.base import Known, Predictor, PredictorKind, topk_ids
from .copy_queue import CacheModel, CopyTiming, LoadState, Priority
from .prefetching import Prediction as Prediction  # re-exported: it lived here
from .residency import Load, used_experts

PROMOE_DISTANCE = 2  # ProMoE's stride: predict layer l+2 at layer l
PROMOE_EXTRA = 1  # m: prefetch the top-(k+m) predicted experts
HIDDEN_KINDS = (PredictorKind.MLP, PredictorKind.GATE, PredictorKind.RESIDUAL)  # predict from h_l alone


def distance_refusal(distance: int) -> str | None:
    """Why promoe cannot predict `distance` MoE layers ahead (None: it can)."""
    return None if distance >= 1 else f"`prefetch_distance={distance!r}`: use >= 1 (ProMoE's stride is 2)"


class PrefetchError(EdgeMoeError):
    """A prefetch policy was set up with a predictor or parameters it cannot use."""


def predicted_experts(scores: np.ndarray, per_token: int, cap: int) -> list[int]:
    """(N, E) scores -> at most `cap` experts to prefetch, best first. One token: its top-per_token by
    score. A ubatch: the experts most tokens have in their top-per_token, then the best rank a token
    gives them, then the lower id."""
    top = topk_ids(scores, per_token)  # (N, per_token)
    if top.shape[0] == 1:
        return [int(e) for e in top[0, :cap]]
    n_expert = scores.shape[1]
    count = np.bincount(top.reshape(-1), minlength=n_expert)
    rank = np.full(n_expert, per_token)
    for r in range(top.shape[1]):
        np.minimum.at(rank, top[:, r], r)
    order = np.lexsort((np.arange(n_expert), rank, -count))
    return [int(e) for e in order if count[e] > 0][:cap]


class PromoePolicy:
    """Stride prefetching with a learned (or gate-reuse) predictor over a per-layer LRU cache."""

    wants_gate_inp = True

    def __init__(
        self,
        n_slots: Mapping[int, int],
        layers: Sequence[int],
        predictor: Predictor,
        *,
        extra: int = PROMOE_EXTRA,
        blocking: bool = False,
        timing: CopyTiming | None = None,
    ) -> None:
        if predictor.kind not in HIDDEN_KINDS:
            raise PrefetchError(
                f"the {predictor.kind.value} predictor does not predict from the router input; "
                f"use one of {', '.join(k.value for k in HIDDEN_KINDS)}"
            )
        if extra < 0:
            raise PrefetchError(
                f"prefetch extra {extra}: use >= 0 (ProMoE's k + m experts, m = {PROMOE_EXTRA})"
            )
        if tuple(layers) != tuple(predictor.spec.layers):
            raise PrefetchError(
                f"the predictor is for MoE layers {list(predictor.spec.layers)}, the cache for "
                f"{list(layers)}: calibrate this model"
            )
        self.n_slots = dict(n_slots)  # layer -> slots
        self.layers = tuple(layers)  # the MoE layers (il), in order
        self.predictor = predictor
        self.distance = predictor.distance
        self.extra = extra
        self.blocking = blocking
        self.timing = None if timing is None or timing.infinite else timing  # admission control (None: none)
        self._pos = {il: j for j, il in enumerate(self.layers)}
        self._predictions: dict[int, Prediction] = {}  # target layer -> its latest prediction
        self._stamp: dict[int, dict[int, int]] = {}  # layer -> expert -> when last touched
        self._clock = 0

    @property
    def per_token(self) -> int:
        """Experts prefetched per token: k + m."""
        return self.predictor.spec.k + self.extra

    def initial_loads(self) -> list[Load]:
        return []

    def prefetch_cap(self, n_tokens: int, n_slots: int) -> int:
        """At most how many predicted experts of a layer with n_slots slots a ubatch of n_tokens prefetches:
        one token its top-(k+m), a ubatch as many as the layer holds."""
        return min(self.per_token, n_slots) if n_tokens == 1 else n_slots

    def take_prediction(self, layer: int) -> Prediction | None:
        """The prediction for `layer` made at an earlier layer, if any (forgotten once taken)."""
        return self._predictions.pop(layer, None)

    def on_route(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None, cache: CacheModel) -> None:
        """Layer `layer` routed `ids` (n_tokens, k) from router input `hidden` (n_tokens, n_embd): act on `cache`."""
        if self.n_slots.get(layer, 0) > 0:
            self._precise(layer, used_experts(ids), cache, int(np.asarray(ids).shape[0]))
        if hidden is not None and len(hidden):
            self._predict(layer, hidden, cache)

    def _precise(self, layer: int, routed: list[int], cache: CacheModel, n_tokens: int) -> None:
        used = set(routed)
        for r in cache.pending(layer):  # early preemption: what was predicted and not chosen
            if r.priority == Priority.SPECULATIVE and r.expert not in used:
                cache.cancel(layer, r.slot)
        for e in routed:  # hits first, so that this layer's loads evict none of its own experts
            if cache.state(layer, e) is LoadState.RESIDENT:
                self._touch(layer, e)
        for e in routed:
            if cache.state(layer, e) is LoadState.RESIDENT:
                continue
            req = cache.request(layer, e)
            if req is not None:
                if req.priority < Priority.PRECISE:  # promote: drop and queue again, precise
                    req.tag = None  # no longer a speculative load: its drop is no preemption
                    cache.cancel(layer, req.slot)
                    cache.prefetch(Load(layer, e, req.slot), Priority.PRECISE)
            else:
                prio = Priority.PRECISE if self.blocking else Priority.REFILL
                slot = self._victim(layer, used, cache)
                if slot is None or (not self.blocking and not self._fits(cache, layer, n_tokens, prio)):
                    continue
                cache.prefetch(Load(layer, e, slot), prio)
            self._touch(layer, e)

    def _predict(self, layer: int, hidden: np.ndarray, cache: CacheModel) -> None:
        j = self._pos.get(layer)
        if j is None or j + self.distance >= len(self.layers) or not self.predictor.covers(j + self.distance):
            return
        t = j + self.distance
        target = self.layers[t]
        n_slots = self.n_slots.get(target, 0)
        if n_slots <= 0:
            return
        h = np.asarray(hidden, dtype=np.float32)
        n = h.shape[0]
        known = Known(
            target=t,
            distance=self.distance,
            hidden=h,
            tokens=np.zeros(n, np.int32),
            prev_ids=np.full((n, self.predictor.spec.k), -1, np.int32),
        )
        cap = self.prefetch_cap(n, n_slots)
        pred = Prediction(
            target, layer, tuple(predicted_experts(self.predictor.scores(known), self.per_token, cap))
        )
        self._predictions[target] = pred
        pinned = set(pred.experts)
        for e in pred.experts:
            if cache.state(target, e) is LoadState.ABSENT:
                slot = self._victim(target, pinned, cache)
                if slot is None or not self._fits(cache, target, self.distance * n, Priority.SPECULATIVE):
                    continue  # every slot holds a pinned expert or is loading; or it would arrive too late
                cache.prefetch(Load(target, e, slot), Priority.SPECULATIVE, tag=pred)
            self._touch(target, e)

    def _fits(self, cache: CacheModel, layer: int, intervals: int, priority: int) -> bool:
        """Can a load of one of the layer's experts queued now at `priority` arrive within `intervals` layer
        times (always, without a timing)?"""
        if self.timing is None:
            return True
        room = self.timing.bandwidth * self.timing.layer_s * intervals
        return cache.queued_bytes(priority) + sum(cache.chunk_bytes[layer]) <= room

    def _victim(self, layer: int, pinned: set[int], cache: CacheModel) -> int | None:
        """A free slot, else the least recently used one whose expert is neither pinned nor loading."""
        best: tuple[int, int] | None = None
        stamps = self._stamp.get(layer, {})
        for s in range(self.n_slots[layer]):
            e, req = cache.occupant(layer, s)
            if e < 0:
                return s
            if req is None and e not in pinned and (best is None or stamps.get(e, -1) < best[0]):
                best = (stamps.get(e, -1), s)
        return None if best is None else best[1]

    def _touch(self, layer: int, expert: int) -> None:
        self._clock += 1
        self._stamp.setdefault(layer, {})[expert] = self._clock
