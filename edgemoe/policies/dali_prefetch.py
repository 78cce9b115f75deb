"""DALI with its prefetcher (Zhu et al., §4.2-4.3) as a policy over the cache model.

`DaliPolicy` (edgemoe.policies.residency) is DALI's workload-aware replacement alone, which runs natively
after each ubatch. This adds the Residual-Based Prefetching of §4.2: at MoE layer l, once its routing and
router input h_l are known,

1. **Workload-aware replacement** (§4.3, Algorithm 2), as `DaliPolicy`: each expert's score is the tokens
   routed to it this window; until the layer's slots are full its misses fill the free ones (most routed
   first, then first use); when the window has seen w tokens the u best experts outside the cache replace the
   u worst inside, pair by pair while the newcomer scores higher, and the scores restart. Those loads are for
   the layer's next run (a miss runs on the CPU this time), queued behind every prediction; a window's swaps
   are queued at the next route, once the layer's experts were mapped (so a swap never turns one of the
   layer's hits into a miss).
2. **Residual-based prefetching** (§4.2, eq. 10-11): the residual predictor (layer l+1's router on
   h_l + res_vec_l; `edgemoe calibrate` fits res_vec, and without a calibration gate reuse stands in) scores
   the experts of layer l+1 for each token; the experts most tokens have in their top-k (the "high-workload"
   ones; one token: its top-k by score) are prefetched, at most `size` of them (the paper's prefetch size: 1
   for Mixtral, 4 to 8 for DeepSeek and Qwen), each into the slot of the resident expert with the lowest score
   this window that is neither predicted nor loading. Speculative loads of layer l that its router then did
   not choose are dropped (early preemption, as promoe does).

Hit, load and GoodPred counters come from edgemoe.policies.replay.PolicyDriver, as for promoe; the engine runs
it in the routing hook (edgemoe.runtime.prefetcher), where the router input is at hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..predictors.base import Predictor
from .copy_queue import CacheModel, CopyTiming, LoadState, Priority
from .daop import swap_pairs
from .promoe import PrefetchError, PromoePolicy
from .residency import DALI_WINDOW, Load, used_experts

DALI_PREFETCH_DISTANCE = 1  # DALI predicts the next MoE layer


DALI_PREFETCH_REFUSAL = (
    "`dali_prefetch` is an option of `policy='dali'` without `blocking` "
    "(a missed expert runs on the CPU while the prefetcher loads the next layer's)"
)


def dali_prefetch_refusal(*, blocking: bool) -> str | None:
    """Why dali's prefetcher cannot run (None: it can): a missed expert runs on the CPU while it loads the next
    layer's, so not with blocking loads. The one statement of the rule, for dali's record and the request check
    (which refuses it with another policy by DALI_PREFETCH_REFUSAL)."""
    return DALI_PREFETCH_REFUSAL if blocking else None


def dali_default_prefetch(n_expert: int) -> int:
    """The paper's prefetch size for a model with n_expert experts per layer: 1 for Mixtral's 8, 4 for more."""
    return 1 if n_expert <= 8 else 4


class DaliPrefetchPolicy(PromoePolicy):
    """DALI's workload-aware replacement with its residual-based prefetcher, per layer."""

    def __init__(
        self,
        n_slots: Mapping[int, int],
        layers: Sequence[int],
        predictor: Predictor,
        n_expert: int,
        *,
        size: int,
        window: int = DALI_WINDOW,
        update: int = 1,
        timing: CopyTiming | None = None,
    ) -> None:
        super().__init__(n_slots, layers, predictor, extra=0, timing=timing)
        if size < 1 or window < 1 or update < 1:
            raise PrefetchError(
                f"dali prefetch size {size}, window {window}, update {update}: each must be >= 1"
            )
        self.n_expert = n_expert
        self.size = size
        self.window = window
        self.update = update
        self._scores: dict[int, np.ndarray] = {}  # layer -> (n_expert,) tokens routed this window
        self._tokens: dict[int, int] = {}  # layer -> tokens this window
        self._swaps: list[Load] = []  # the last layer's window swaps, queued at the next route

    def prefetch_cap(self, n_tokens: int, n_slots: int) -> int:
        return min(self.size, n_slots)

    def on_route(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None, cache: CacheModel) -> None:
        for ld in self._swaps:  # after their layer's ids were mapped to slots: no hit of it becomes a miss
            cache.prefetch(ld, Priority.REFILL)
        self._swaps = []
        if self.n_slots.get(layer, 0) > 0:
            self._replace(layer, np.asarray(ids), cache)
        if hidden is not None and len(hidden):
            self._predict(layer, hidden, cache)

    def _replace(self, layer: int, ids: np.ndarray, cache: CacheModel) -> None:
        flat = ids.reshape(-1)
        counts = np.bincount(flat[flat >= 0], minlength=self.n_expert)
        scores = self._scores.setdefault(layer, np.zeros(self.n_expert, np.int64))
        scores += counts
        used = used_experts(ids)
        for r in cache.pending(layer):  # early preemption: predicted, then not chosen
            if r.priority == Priority.SPECULATIVE and r.expert not in used:
                cache.cancel(layer, r.slot)
        free = [s for s in range(self.n_slots[layer]) if cache.occupant(layer, s) == (-1, None)]
        if free:  # warm-up: the misses fill the free slots, most routed first
            misses = sorted(
                (e for e in used if cache.state(layer, e) is LoadState.ABSENT),
                key=lambda e: (-counts[e], used.index(e)),
            )
            for e, s in zip(misses, free, strict=False):
                cache.prefetch(Load(layer, e, s), Priority.REFILL)
        self._tokens[layer] = self._tokens.get(layer, 0) + int(ids.shape[0])
        if self._tokens[layer] < self.window:
            return
        placed = {}  # what replacement placed: resident experts and its own queued loads (not predictions)
        for s in range(self.n_slots[layer]):
            e, req = cache.occupant(layer, s)
            if e >= 0 and (req is None or req.priority == Priority.REFILL):
                placed[e] = s
        absent = [e for e in range(self.n_expert) if cache.state(layer, e) is LoadState.ABSENT]
        for e_in, e_out in swap_pairs(scores, placed, threshold=1.0, max_pairs=self.update, outside=absent):
            self._swaps.append(Load(layer, e_in, placed[e_out]))
        scores[:] = 0
        self._tokens[layer] = 0

    def _victim(self, layer: int, pinned: set[int], cache: CacheModel) -> int | None:
        """A free slot, else the slot of the resident expert with the lowest score this window (ties: lower
        id) that is neither pinned nor loading."""
        scores = self._scores.get(layer)
        best: tuple[int, int, int] | None = None
        for s in range(self.n_slots[layer]):
            e, req = cache.occupant(layer, s)
            if e < 0 and req is None:
                return s
            if e >= 0 and req is None and e not in pinned:
                key = (int(scores[e]) if scores is not None else 0, e, s)
                best = key if best is None or key < best else best
        return None if best is None else best[2]
