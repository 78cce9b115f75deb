"""What the rest of edgemoe asks of a policy of the prefetcher family (a spec whose `prefetch` builds one: promoe,
dali with a prefetch size): the Prefetcher protocol, and the Prediction it makes. The replay driver and the
engine's controllers talk to this protocol, never to a policy's class (edgemoe.policies.promoe is one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..predictors.base import Predictor
from .copy_queue import CacheModel, CopyTiming
from .loads import Load


@dataclass(frozen=True, eq=False)  # identity: the tag of the loads it queued
class Prediction:
    target: int  # model layer (il) predicted
    source: int  # model layer whose router input predicted it
    experts: tuple[int, ...]  # best first


@runtime_checkable
class Prefetcher(Protocol):
    """A prefetching policy: at each MoE layer its predictor names the experts of the layer `distance` ahead from
    the router input, which it queues on the cache model's copy stream; an LRU otherwise."""

    @property
    def n_slots(self) -> Mapping[int, int]:
        """layer -> slots."""
        ...

    predictor: Predictor
    distance: int  # MoE layers ahead it predicts
    extra: int  # experts prefetched beyond the model's top-k
    blocking: bool  # a miss is loaded before its layer runs
    timing: CopyTiming | None  # admission control (None: every queued chunk at once)

    @property
    def per_token(self) -> int:
        """Experts prefetched per token."""
        ...

    def initial_loads(self) -> list[Load]: ...

    def prefetch_cap(self, n_tokens: int, n_slots: int) -> int:
        """At most how many predicted experts of a layer with n_slots slots a ubatch of n_tokens prefetches."""
        ...

    def take_prediction(self, layer: int) -> Prediction | None:
        """The latest prediction of `layer`'s experts (taken: the next call returns None until another)."""
        ...

    def on_route(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None, cache: CacheModel) -> None:
        """Layer `layer` routed `ids` from router input `hidden`: queue its loads and prefetches on `cache`."""
        ...
