"""Context tiers: the KV cache allocated in steps as the conversation grows, and the expert slots the smaller steps
leave (the fallback for lending the unwritten KV cells to the experts; docs/expert-cache.md, "Context
tiers").

llama.cpp allocates a context's whole KV cache when the context is created. While a conversation is short most of
those cells are never written, yet their bytes are not in the expert slots. With tiers the engine creates its
context at the smallest tier that holds the tokens, with the slots that tier's budget leaves, and re-creates it
at the next tier (fewer slots) when the sequence would outgrow it: the KV state is copied to host memory and
back (llama_state_seq_get_data / _set_data), and everything set on the context (the expert cache with the
tier's slots, the routing hook, adaptive top-k, the predictors in the graph) is set again. A prompt that reuses
nothing starts again at the smallest tier that holds it. The cache's contents start over at each step (it is a
cache: nothing is lost but hits).

Lending the cells themselves (expert slots inside the KV buffers' unwritten tail, evicted before a cell is
written) is not built: llama.cpp's attention reads every cell up to its padded window (256 cells past the last
one in use), free cells included, so the contents of cells no sequence holds reach the scores (see
tests/test_kv_lending_safety.py); lending would have to stay above that window, and without flash attention the
V cache is transposed, so its unwritten cells are not one block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ..errors import InvalidConfigError, ModelLoadError
from .cache_config import CacheConfig, checked_slots
from .handle import NativeHandle
from .prediction import GraphPredictors
from .prompt_cache import KVSnapshot
from .routing import Routing

# re-exported: they lived here
from .tier_rules import INEXACT as INEXACT
from .tier_rules import LONGROPE as LONGROPE
from .tier_rules import tiers_refusal as tiers_refusal


@dataclass(frozen=True)
class ContextTier:
    """One step: a context of n_ctx tokens, and the expert slots per MoE layer beside it (None: the cache's as
    they are, or no cache)."""

    n_ctx: int
    slots: int | Mapping[int, int] | None = None


@dataclass(frozen=True)
class ContextTiers:
    """The steps in order of size; the last is the engine's whole context (Engine.n_ctx)."""

    tiers: tuple[ContextTier, ...]

    def __post_init__(self) -> None:
        sizes = [t.n_ctx for t in self.tiers]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise InvalidConfigError(
                f"context tiers {sizes}: give one or more distinct sizes in increasing order"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t.n_ctx for t in self.tiers)

    def tier_for(self, n_tokens: int) -> ContextTier | None:
        """The smallest tier that holds n_tokens (None: none does)."""
        return next((t for t in self.tiers if t.n_ctx >= n_tokens), None)


@dataclass(frozen=True)
class ContextResize:
    """One re-creation of the context at another tier."""

    from_ctx: int
    to_ctx: int
    tokens: int  # the sequence's tokens carried over (0: nothing was kept)
    slots: int | None  # expert slots in all MoE layers together after it (None: no cache)
    seconds: float


class CarryKV(Protocol):
    """How a resize saves the sequence's K/V and puts them back (KVSequence implements it)."""

    def save(self, n: int) -> KVSnapshot:
        """The first n tokens' KV state in host memory."""
        ...

    def cleared(self) -> None:
        """The context was re-created: the KV cache is empty."""
        ...

    def load(self, snap: KVSnapshot) -> None:
        """Put a saved state back (the context holds it)."""
        ...


class ContextResizer:
    """Keeps an engine's context at the tier its sequence needs (Engine.set_context_tiers)."""

    def __init__(
        self,
        handle: NativeHandle,
        routing: Routing,
        prefetch: GraphPredictors,
        tiers: ContextTiers,
        *,
        carry: CarryKV,
        after: Callable[[], None] = lambda: None,
    ) -> None:
        self.handle = handle
        self.routing = routing
        self.prefetch = prefetch
        self.tiers = tiers
        self.carry = carry  # the sequence's KV to host memory and back
        self.after = after  # the engine's settings on a new context (its id-row check)
        self.current = tiers.tiers[-1]  # the engine's context is created whole
        self.resizes: list[ContextResize] = []

    def fit(self, n_tokens: int, kept: int) -> None:
        """Before the sequence holds n_tokens, `kept` of them already in the KV cache: grow to the tier that holds
        them when this context does not, and, when nothing is kept, move to the smallest tier that holds them.
        Past the last tier nothing changes (the caller's overflow check then speaks)."""
        target = self.tiers.tier_for(max(1, n_tokens))
        if target is None or target == self.current:
            return
        if kept and (target.n_ctx < self.current.n_ctx or n_tokens <= self.handle.n_ctx):
            return  # never below the tokens kept, and never a copy of them that is not needed
        self.resize(target, kept)

    def resize(self, tier: ContextTier, kept: int) -> None:
        """Re-create the context at `tier`, carrying the first `kept` tokens' K/V over. Where llama.cpp cannot
        create it (ModelLoadError, raised), the context is made again at the size it had, with what it held."""
        t0 = time.perf_counter()
        before, config, device = self.handle.n_ctx, self.routing.cache_config, self.routing.cache_device
        snap = self.carry.save(kept) if kept else None
        self.routing.close_experts()
        try:
            self.handle.resize(tier.n_ctx)
        except ModelLoadError:
            self._set_up(config, device, snap)  # handle.resize made the old size again
            raise
        self.current = tier
        if config is not None and tier.slots is not None:
            config = replace(config, slots_per_layer=tier.slots)
        self._set_up(config, device, snap)
        experts = self.routing.experts
        slots = sum(experts.cache.n_slots.values()) if experts is not None else None
        self.resizes.append(ContextResize(before, self.handle.n_ctx, kept, slots, time.perf_counter() - t0))

    def _set_up(self, config: CacheConfig | None, device: object, snap: KVSnapshot | None) -> None:
        """Everything a new context needs set again: the predictors, the expert cache (or the hook alone), the
        engine's own settings, then the carried K/V."""
        self.carry.cleared()
        self.prefetch.reapply()
        if config is not None:
            self.routing.enable_expert_cache(config, device)
            if self.routing.experts is not None:
                self.routing.experts.mark("start")  # a generation's prefill/decode split starts over here
        else:
            self.routing.rewire()
        self.after()
        if snap is not None:
            self.carry.load(snap)


def check_tiers(
    tiers: ContextTiers, *, n_ctx: int, n_batch: int, moe_layers: Sequence[int] = (), n_expert: int = 0
) -> None:
    """Tiers an engine of n_ctx tokens, decoding n_batch at a time, can run: the last is its context, none holds
    fewer than a batch (llama.cpp would shrink the batch, and the ubatches would differ from stock's), each one's
    slots in range for the model's MoE layers (ExpertCacheError)."""
    for t in tiers.tiers:
        if t.slots is not None:
            checked_slots(t.slots, moe_layers, n_expert)
    sizes: Sequence[int] = tiers.sizes
    if sizes[-1] != n_ctx:
        raise InvalidConfigError(
            f"context tiers {list(sizes)}: the last must be the engine's context ({n_ctx} tokens)"
        )
    if sizes[0] < n_batch:
        raise InvalidConfigError(
            f"context tier {sizes[0]} holds fewer tokens than a batch ({n_batch}): start the tiers at {n_batch} "
            "or more"
        )
