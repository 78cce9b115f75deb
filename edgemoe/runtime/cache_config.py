"""The expert cache's configuration: `CacheConfig` holds what every policy shares (slots, overlap, loads,
prefill, pre-calculation), and one frozen record per residency policy holds that policy's own options (each
defined beside its spec in edgemoe.policies.kinds, re-exported here). `policy_config(name, **options)` builds the
record of a policy named on a command line (docs/expert-cache.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import EdgeMoeError
from ..policies.copy_queue import load_worker_default
from ..policies.kinds import DaliConfig, DaopConfig, LruConfig, ManualConfig, PromoeConfig, StaticConfig
from ..policies.protected import ProtectedExperts
from ..policies.registry import PolicyRecord, calibrated_config, policy_config, policy_options

__all__ = [  # the records and their builders are re-exported: they lived here
    "CacheConfig",
    "DaliConfig",
    "DaopConfig",
    "ExpertCacheError",
    "LruConfig",
    "ManualConfig",
    "PolicyConfig",
    "PromoeConfig",
    "StaticConfig",
    "calibrated_config",
    "checked_slots",
    "policy_config",
    "policy_options",
]


class ExpertCacheError(EdgeMoeError):
    """The expert cache cannot be set up for this model or configuration."""


PolicyConfig = PolicyRecord  # any registered policy's record (edgemoe.policies.kinds)


@dataclass(frozen=True)
class CacheConfig:
    """An expert cache for Engine.enable_expert_cache: its slots, its policy (one of the records above) and what
    every policy shares."""

    # expert slots of every MoE layer (equal allocation), or layer -> slots (e.g. from
    # edgemoe.policies.allocation's dp_allocate; MoE layers left out get none)
    slots_per_layer: int | Mapping[int, int]
    # the residency policy and its options (policy_config builds one from a name)
    policy: PolicyConfig = field(default_factory=LruConfig)
    alloc: str = "equal"  # how the slots per layer were chosen ("equal", "dp"): reported, not acted on
    # on a device: compute the cached experts there while the CPU computes the others (llama_moe_cache_set_overlap);
    # False runs the two one after the other, as llama.cpp's scheduler does
    overlap: bool = True
    # on a device: llama.cpp's load worker thread issues the queued loads while the caller computes
    # (llama_moe_cache_set_async); False issues them on the caller's thread. None: the worker, except on
    # llama.cpp's RPC device, whose one connection carries the copies and the graph runs in one FIFO, so a
    # worker overlaps nothing there and only competes for the CPU (tools/bench_worker.py). promoe always issues
    # its own loads (its model of the copy queue counts the chunks)
    async_loads: bool | None = None
    # prefill on the device: a ubatch of at least this many tokens runs each cached layer's other
    # experts (routed, outside the slots) on the cache's device too, from two buffers of a whole layer's experts
    # (their bytes come out of the budget: prefill_buffer_bytes), copied one cached layer ahead on the copy stream
    # while the layer before computes; 0: off (they run on the CPU, or llama.cpp's op offload copies them)
    prefill_min_tokens: int = 0
    # what a prefill layer copies ahead for the next cached layer: "all" (its experts outside the slots),
    # "predicted" (those the in-graph predictor from this layer names: promoe's), "routed" (nothing ahead: each
    # layer copies what it routes at its routing callback, the compute waiting)
    prefill_ahead: str = "all"
    # the two prefill buffers borrow the slots of the last cached layers instead of their own memory: those
    # layers' experts are evicted when a prefill ubatch starts and refilled after the prefill (at the first
    # smaller ubatch) with the experts it routed most in each; the budget then gives the buffers' bytes to slots
    prefill_borrow: bool = False
    # DAOP's pre-calculation: in ubatches of at most precalc_max_tokens tokens (decode), each cached
    # MoE layer from this index on has its experts predicted at the MoE layer before by its own router on that
    # layer's input (gate reuse); the predicted ones outside its slots run on that input, on the CPU, while the
    # device computes the layer's attention and routing, and it takes their results instead of running them (an
    # approximation: the output changes; docs/research/daop.md).
    # Needs the cache's tables in the graph (no routing hook: --degrade, --assign, --blocking-loads, Python
    # policies turn it off). None: off
    precalc_from: int | None = None
    precalc_max_tokens: int = 1
    # DAOP's graceful degradation (edgemoe.policies.degrade): in decode, a token's non-resident expert (not
    # its best) is replaced by the best resident one it did not select whose router score is at least this
    # ratio of the replaced one's (0 < r <= 1; None: off). Changes the routing; runs in the routing hook
    degrade: float | None = None
    # experts the degradation never swaps out or in (the calibration's super experts, edgemoe.policies.protected)
    protected: ProtectedExperts = field(default_factory=ProtectedExperts)

    @property
    def prefetcher(self) -> bool:
        """Does a prefetcher run this cache from the routing hook (promoe, dali with a prefetch size)?"""
        return self.policy.prefetcher

    def overlap_on(self, environ: Mapping[str, str]) -> bool:
        """Whether to overlap the device's experts with the CPU's: not with GGML_CUDA_GRAPH_OPT=1, llama.cpp's
        opt-in concurrent streams, which could fork in the first part of an overlapped split and join in its
        second (unverified either way: off is the safe order)."""
        return self.overlap and environ.get("GGML_CUDA_GRAPH_OPT", "0") != "1"

    def loads_async(self, device: Any) -> bool:
        """Whether the load worker may issue this cache's loads on device (None: the CPU stand-in, which has none);
        a controller that issues its own (the hook's prefetchers: CacheController.issues_own_loads) turns it off."""
        if device is None:
            return False
        if self.async_loads is not None:
            return self.async_loads
        from . import native  # here: the config itself is pure (the planner reads it without the library)

        return load_worker_default(native.device_name(device))

    def slots(self, moe_layers: Sequence[int], n_expert: int) -> dict[int, int]:
        """Slots of each MoE layer, checked: 0..n_expert each, and only MoE layers named."""
        return checked_slots(self.slots_per_layer, moe_layers, n_expert)


def checked_slots(
    slots_per_layer: int | Mapping[int, int], moe_layers: Sequence[int], n_expert: int
) -> dict[int, int]:
    """Slots of each MoE layer from an equal count or a layer -> slots mapping: 0..n_expert each, and only MoE
    layers named."""
    if isinstance(slots_per_layer, int):
        per = {il: slots_per_layer for il in moe_layers}
    else:
        per = {il: int(slots_per_layer.get(il, 0)) for il in moe_layers}
        extra = sorted(set(slots_per_layer) - set(moe_layers))
        if extra:
            raise ExpertCacheError(
                f"slots for layers {extra}, which are not MoE layers of this model "
                f"(its MoE layers: {list(moe_layers)})"
            )
    bad = {il: n for il, n in per.items() if not 0 <= n <= n_expert}
    if bad:
        il, n = next(iter(bad.items()))
        where = "" if isinstance(slots_per_layer, int) else f" (layer {il})"
        raise ExpertCacheError(
            f"`expert_slots={n!r}`{where}: use 0..{n_expert} (the model has {n_expert} experts per layer)"
        )
    return per
