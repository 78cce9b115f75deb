"""The engine side of the expert cache: slots per layer (equal or per layer), loads, counters.

`ExpertCache` wraps one context's cache (llama_moe_cache_*); `CacheController` runs a
residency policy (edgemoe.policies.residency): inside llama.cpp's graph with the expert-to-slot
tables, or as a route policy in the hook that applies its loads now (blocking) or
after the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..gguf.header import GgufHeader, check_gguf
from ..policies.degrade import GracefulDegradation
from ..policies.loads import Reseedable, split_loads
from ..policies.miss_assignment import AssignedPolicy
from ..policies.prefetching import Prefetcher
from ..policies.registry import NativeStep
from ..policies.residency import Load, ResidencyPolicy
from ..policies.route import RouteRecord
from . import native
from .cache_config import ExpertCacheError, checked_slots
from .native import lib

_STATE_NAMES = {
    native.MOE_CACHE_ABSENT: "absent",
    native.MOE_CACHE_QUEUED: "queued",
    native.MOE_CACHE_COPYING: "copying",
    native.MOE_CACHE_RESIDENT: "resident",
}
# the GGUF names (blk.{il}. + name) of a layer's stacked expert tensors in llama_moe_cache_set_source's
# order: the weights, their biases (gpt-oss), the per-expert scales
EXPERT_TENSORS = (
    "ffn_gate_up_exps.weight",
    "ffn_up_exps.weight",
    "ffn_gate_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_up_exps.bias",
    "ffn_up_exps.bias",
    "ffn_gate_exps.bias",
    "ffn_down_exps.bias",
    "ffn_up_exps.scale",
    "ffn_gate_exps.scale",
    "ffn_down_exps.scale",
)


def expert_chunk_bytes(model: Path | GgufHeader, layers: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Bytes of each chunk of one expert per MoE layer, in the order llama.cpp copies them (EXPERT_TENSORS):
    a stacked tensor's bytes over its experts. `model`: a GGUF's path or its parsed header."""
    header = model if isinstance(model, GgufHeader) else check_gguf(model)
    by_name = {t.name: t for t in header.tensors}
    out = {}
    for il in layers:
        ts = [by_name[f"blk.{il}.{name}"] for name in EXPERT_TENSORS if f"blk.{il}.{name}" in by_name]
        out[il] = tuple(int(t.nbytes // t.shape[-1]) for t in ts)
    return out


def precalc_rates(st: Mapping[str, int]) -> dict[str, float | None]:
    """precision (used / computed) and early_share (used / (used + late)) of pre-calculation counters."""
    cpu = st["used"] + st["late"]
    return {
        "precision": st["used"] / st["computed"] if st["computed"] else None,
        "early_share": st["used"] / cpu if cpu else None,
    }


class ExpertCache:
    """The slots of one context. device None: the CPU buffer that stands in for a GPU.

    Loads read the experts' bytes from the GGUF file (mapped here, read-only), so the model's own
    expert tensors may be repacked for the CPU or live anywhere.
    """

    def __init__(
        self,
        ctx: Any,
        header: GgufHeader,
        moe_layers: list[int],
        n_layer: int,
        n_expert: int,
        slots_per_layer: int | Mapping[int, int],
        device: Any = None,
    ) -> None:
        self._ctx = ctx
        self._marks: tuple[tuple[int, int], tuple[int, int]] | None = (
            None  # (hits, misses) at prefill start, end
        )
        self.prefill_min_tokens = 0  # set_prefill
        self.prefill_borrow = False  # set_prefill(borrow=True)
        self.precalc: tuple[int, int] | None = None  # set_precalc: (first layer, most tokens)
        self.n_expert = n_expert
        self.n_slots = checked_slots(slots_per_layer, moe_layers, n_expert)
        per_layer = [self.n_slots.get(il, 0) for il in range(n_layer)]
        rc = native.moe_cache_init(ctx, per_layer, device)
        if rc != 0:
            raise ExpertCacheError(
                f"the expert cache could not be set up (code {rc}): {native.recent_log()[-300:].strip()}"
            )
        cached = [il for il, n in self.n_slots.items() if n > 0]
        self._map = self._set_sources(header, cached)
        self.chunk_bytes = expert_chunk_bytes(header, cached)

    def _set_sources(self, header: GgufHeader, layers: list[int]) -> np.memmap | None:
        if not layers:
            return None
        where = {t.name: header.data_offset + t.offset for t in header.tensors}
        mapped = np.memmap(header.path, dtype=np.uint8, mode="r")
        base = mapped.ctypes.data
        for il in layers:
            ptrs = [
                base + where[f"blk.{il}.{name}"] if f"blk.{il}.{name}" in where else None
                for name in EXPERT_TENSORS
            ]
            if not native.moe_cache_set_source(self._ctx, il, ptrs):
                raise ExpertCacheError(
                    f"layer {il}: the GGUF's expert tensors do not match the model's "
                    f"({native.recent_log()[-200:].strip()})"
                )
        return mapped

    def load(self, ld: Load) -> None:
        if not native.moe_cache_load(self._ctx, ld.layer, ld.expert, ld.slot):
            raise ExpertCacheError(
                f"loading expert {ld.expert} into slot {ld.slot} of layer {ld.layer} failed"
            )

    def prefetch(self, ld: Load, priority: int = 0) -> None:
        """Queue ld; it is copied as issue() sends its chunks and used once its layer runs after that."""
        if not native.moe_cache_prefetch(self._ctx, ld.layer, ld.expert, ld.slot, priority):
            raise ExpertCacheError(
                f"prefetching expert {ld.expert} into slot {ld.slot} of layer {ld.layer} failed"
            )

    def cancel(self, layer: int, slot: int) -> None:
        """Drop the loads queued into the slot and empty it (llama_moe_cache_load with expert -1: the native
        API's only way to drop a queued load; it waits for the copies in flight on a device)."""
        if not native.moe_cache_load(self._ctx, layer, -1, slot):
            raise ExpertCacheError(f"emptying slot {slot} of layer {layer} failed")

    def issue(self, max_chunks: int = 2**31 - 1) -> int:
        return native.moe_cache_issue_loads(self._ctx, max_chunks)

    def sync(self) -> None:
        native.moe_cache_sync(self._ctx)

    def state(self, layer: int, expert: int) -> str:
        return _STATE_NAMES[native.moe_cache_state(self._ctx, layer, expert)]

    def slots(self, layer: int) -> list[int] | None:
        """Slot of each expert of the layer (-1: not resident)."""
        return native.moe_cache_slots(self._ctx, layer, self.n_expert)

    def reset_stats(self) -> None:
        native.moe_cache_reset_stats(self._ctx)
        self._marks = None

    def _counts(self) -> tuple[int, int]:
        lib.llama_synchronize(self._ctx)  # the last ubatch's routes count once they are read back
        st = native.moe_cache_stats(self._ctx)
        return int(st.hits), int(st.misses)

    def mark(self, phase: str) -> None:
        """Called by a generation: "start" before its prefill, "decode" after it; stats() then splits the last
        generation's hits into prefill and decode (prefill ubatches touch most experts and would dominate)."""
        now = self._counts()
        self._marks = (now, now) if phase == "start" or self._marks is None else (self._marks[0], now)

    def _phase_rates(self, h2: int, m2: int) -> dict[str, float | None]:
        """Hit rates of the last generation's prefill and decode, given the counters now."""
        if self._marks is None:
            return {"prefill_hit_rate": None, "decode_hit_rate": None}
        (h0, m0), (h1, m1) = self._marks

        def rate(h: int, m: int) -> float | None:
            return h / (h + m) if h + m else None

        return {"prefill_hit_rate": rate(h1 - h0, m1 - m0), "decode_hit_rate": rate(h2 - h1, m2 - m1)}

    def stats(self) -> dict[str, Any]:
        lib.llama_synchronize(self._ctx)  # the last ubatch's routes count once they are read back
        st = native.moe_cache_stats(self._ctx)
        routed = st.hits + st.misses
        share = st.hits / routed if routed else 0.0
        return {
            "hits": int(st.hits),
            "misses": int(st.misses),
            "hit_rate": share,
            **self._phase_rates(int(st.hits), int(st.misses)),
            "loads": int(st.loads),
            "bytes_uploaded": int(st.bytes_loaded),
            "prefetches": int(st.prefetches),
            "chunks": int(st.chunks),
            "preempted": int(st.preempted),
            "blocked_s": st.us_blocked / 1e6,
            # host time queueing copies (on the CPU stand-in the copies, which the compute waits for), and
            # the loads the compute stream was ordered to wait for at the start of a ubatch
            "issue_s": st.us_issue / 1e6,
            "load_waits": int(st.load_waits),
            # the chunks llama.cpp's load worker issued, the ubatches whose routes its policy step processed
            # (hits counted, the native lru/dali/daop run), and the time the caller waited for its chunk or step
            "worker_chunks": int(st.chunks_async),
            "worker_policy_steps": int(st.routes_async),
            "worker_wait_s": st.us_worker / 1e6,
            # of the load waits, those the worker timed, and their summed time from the ubatch's start to
            # the copies' end: an upper bound on how long the compute stalled on loads (None: not timed)
            "load_waits_timed": int(st.waits_timed),
            "load_wait_s": st.us_load_wait / 1e6 if st.waits_timed else None,
            # the chunks sent from a staging buffer in the device's host memory (pinned on CUDA)
            "staged_chunks": int(st.chunks_staged),
            # routed expert slots computed from the cache (the GPU) among those of cached layers
            # (layers given no slots are left out of every counter)
            "gpu_expert_share": share,
            "slots_per_layer": dict(self.n_slots),
            "slots_total": sum(self.n_slots.values()),
        }

    def set_prefill(self, min_tokens: int, ahead: str = "all", *, borrow: bool = False) -> None:
        """Run prefill ubatches of min_tokens+ tokens on the cache's device from two prefill buffers, copied one
        cached layer ahead (0: off). borrow: the buffers lie over the slots of the last cached layers, lent while
        a prefill runs and refilled after it with the experts it routed most, instead of memory of their own."""
        if ahead not in native.MOE_PREFILL_AHEAD:
            raise ExpertCacheError(
                f"prefill ahead {ahead!r}: use one of {', '.join(native.MOE_PREFILL_AHEAD)}"
            )
        if min_tokens < 0:
            raise ExpertCacheError(f"prefill from {min_tokens} tokens: use 0 (off) or a positive token count")
        native.moe_cache_set_prefill_borrow(self._ctx, borrow)  # applies to the set_prefill below
        rc = native.moe_cache_set_prefill(self._ctx, min_tokens, native.MOE_PREFILL_AHEAD[ahead])
        if rc != 0:  # llama.cpp turned device prefill off
            self.prefill_min_tokens, self.prefill_borrow = 0, False
        if rc == -3:
            raise ExpertCacheError(
                "the cached layers' slots cannot hold the two prefill buffers (a whole layer's experts each): "
                "give the cache more slots or leave `prefill_borrow` off"
            )
        if rc != 0:
            raise ExpertCacheError(
                f"llama.cpp could not allocate the two prefill buffers ({rc}): "
                f"{native.recent_log()[-200:].strip()}; lower `vram`/`expert_slots` or leave "
                "`device_prefill` off"
            )
        self.prefill_min_tokens = min_tokens
        self.prefill_borrow = borrow and min_tokens > 0

    def prefill_return(self) -> int:
        """Give the slots lent to the prefill buffers back now (a generation's first decode step does it
        anyway) and queue their refill: the experts queued (0: none were lent)."""
        return native.moe_cache_prefill_return(self._ctx)

    def borrow_stats(self) -> dict[str, int] | None:
        """The lent slots (None: not borrowing): layers, slots and bytes lent; prefills that borrowed them, the
        experts evicted then, refilled after (and their bytes), and the loads refused while lent."""
        if not self.prefill_borrow:
            return None
        lib.llama_synchronize(self._ctx)
        return native.moe_cache_borrow_stats(self._ctx)

    def prefill_stats(self) -> dict[str, Any] | None:
        """The prefill buffers' counters since the last reset (None: off): ubatches and layers run from them, the
        experts they needed, copied ahead (and of those used) or late (the compute waited), bytes copied, and
        the buffers' size."""
        if not self.prefill_min_tokens:
            return None
        lib.llama_synchronize(self._ctx)
        st = native.moe_cache_prefill_stats(self._ctx)
        ahead = st["ahead"]
        borrow = self.borrow_stats()
        return {
            **st,
            "min_tokens": self.prefill_min_tokens,
            **({"borrow": borrow} if borrow is not None else {}),
            "ahead_precision": st["ahead_used"] / ahead if ahead else None,
            "late_share": st["late"] / st["needed"] if st["needed"] else None,
        }

    def set_precalc(self, first_layer: int | None, max_tokens: int = 1) -> None:
        """DAOP's pre-calculation for the cached layers from first_layer on, in ubatches of at most max_tokens
        tokens (None: off)."""
        if first_layer is not None and first_layer < 1:
            raise ExpertCacheError(
                f"pre-calculation from layer {first_layer}: use a layer >= 1 (the first target "
                "layer; its experts are computed at the MoE layer before it)"
            )
        if max_tokens < 1:
            raise ExpertCacheError(
                f"pre-calculation in ubatches of at most {max_tokens} tokens: use 1 or more"
            )
        on = first_layer is not None
        if native.moe_cache_set_precalc(self._ctx, first_layer if on else -1, max_tokens if on else 0) != 0:
            raise ExpertCacheError(
                f"llama.cpp refused the pre-calculation: {native.recent_log()[-200:].strip()}"
            )
        self.precalc = (first_layer, max_tokens) if first_layer is not None else None

    def precalc_stats(self) -> dict[str, Any] | None:
        """The pre-calculation's counters since the last reset (None: off): layer runs that took it, experts
        computed one layer early, of those used (routed), and the routed experts outside the slots run late;
        precision (used / computed) and early_share (used / (used + late): the CPU's expert executions moved a
        layer earlier)."""
        if self.precalc is None:
            return None
        lib.llama_synchronize(self._ctx)
        st = native.moe_cache_precalc_stats(self._ctx)
        return {**st, "first_layer": self.precalc[0], "max_tokens": self.precalc[1], **precalc_rates(st)}

    def close(self) -> None:
        native.moe_cache_init(self._ctx, None)
        self._map = None  # after the cache is gone: nothing reads the mapping any more


class CacheResidency:
    """The experts resident in a cache's slots now, per layer (edgemoe.policies.degrade.Residency)."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache

    def resident(self, layer: int) -> set[int]:
        return {e for e, slot in enumerate(self.cache.slots(layer) or []) if slot >= 0}


class CacheController:
    """Runs a residency policy: inside llama.cpp when it can, else as a route policy in the hook.

    In the graph: the cached layers split their ids with expert-to-slot tables, with no
    host sync per layer; lru, dali and daop run natively after each ubatch (the same decisions as
    LruPolicy, DaliPolicy and DaopPolicy, their loads prefetched on the copy stream and used
    from the next ubatch), static and manual never load by themselves. In the hook (a Python policy is set,
    or blocking loads): the policy sees each layer's final ids. Blocking: copied before the layer's
    experts run. Otherwise prefetched on the copy stream from the next layer's hook (after this
    layer's ids were mapped to slots, so an eviction never turns this step's hit into a miss) while
    the later layers compute, and used from the layer's next run.
    """

    wants_probs = False
    wants_gate_inp = False
    issues_own_loads = False  # the hook's prefetchers issue the chunks themselves (no load worker)

    def __init__(
        self,
        cache: ExpertCache,
        policy: ResidencyPolicy | AssignedPolicy | Prefetcher,
        *,
        alloc: str = "equal",
        native_step: NativeStep | None = None,
        routed: bool = True,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.alloc = alloc  # how the slots per layer were chosen
        self.native_step = native_step  # the step llama.cpp runs it by in the graph (None: only in the hook)
        self._routed = routed  # its loads depend on the routes (its spec's loads_misses)
        self.degradation: GracefulDegradation | None = None  # run in the hook just before this controller
        self.pending: list[Load] = []
        self.mode = native.MOE_CACHE_POLICY_CALLBACK  # what llama_moe_cache_init starts with
        for ld in policy.initial_loads():
            cache.load(ld)

    @property
    def needs_routes(self) -> bool:
        """A placement that never changes by the routes (static, manual) does not need the hook (nor its cost)."""
        return self._routed

    @property
    def native_policy(self) -> int:
        """The llama_moe_cache_policy that runs this policy in the graph (CALLBACK: it needs the hook)."""
        step = self.native_step
        return native.MOE_CACHE_POLICY_CALLBACK if step is None else native.MOE_CACHE_STEPS[step.step]

    def set_mode(self, policy: int) -> None:
        """Hand the policy to llama.cpp (policy != CALLBACK) or take it back into the hook."""
        if policy == self.mode:
            return
        step = self.native_step
        if step is not None and policy == native.MOE_CACHE_STEPS[step.step]:
            if native.moe_cache_set_step(self.cache._ctx, step.step, step.params) != 0:
                raise ExpertCacheError(f"llama.cpp refused {step.what}: {native.recent_log()[-200:].strip()}")
        if native.moe_cache_set_policy(self.cache._ctx, policy) != 0:
            raise ExpertCacheError(
                f"llama.cpp refused cache policy {policy}: {native.recent_log()[-200:].strip()}"
            )
        if (
            policy == native.MOE_CACHE_POLICY_CALLBACK
            and step is not None
            and isinstance(self.policy, Reseedable)
        ):
            # the Python LRU (DALI, DAOP) goes on from what is resident (the native one did the same the other way)
            self.cache.sync()
            self.policy.reseed({il: self.cache.slots(il) or [] for il in self.cache.n_slots})
        self.mode = policy

    def on_route(self, route: RouteRecord) -> None:
        self.flush()
        policy = cast(
            ResidencyPolicy | AssignedPolicy, self.policy
        )  # a prefetcher's controller routes it itself
        now, self.pending = split_loads(policy, policy.on_route(route.layer, route.ids))
        for ld in now:  # before this layer's experts run: the C side maps the ids after the hook
            self.cache.load(ld)

    def graph_predictors(self) -> tuple[list[Any], int, Any] | None:
        """The predictors llama.cpp's graph evaluates for this controller's policy, the experts per token they
        name and their weights' type (None: none; a prefetcher run inside llama.cpp has one)."""
        return None

    def report(self) -> dict[str, Any]:
        """What the controller adds to the cache's stats (the assigner's, the prefetcher's counters)."""
        assigned = getattr(self.policy, "report", None)  # an assigner over the policy reports its counters
        out: dict[str, Any] = {"assign": assigned()} if callable(assigned) else {}
        if self.degradation is not None:
            out["degrade"] = self.degradation.report()
        prefill = self.cache.prefill_stats()
        if prefill is not None:
            out["prefill"] = prefill
        precalc = self.cache.precalc_stats()
        if precalc is not None:
            out["precalc"] = precalc
        return out

    def flush(self) -> None:
        """Prefetch and issue the loads decided at an earlier layer (the engine calls it after each decode)."""
        for ld in self.pending:
            self.cache.prefetch(ld)
        if self.pending:
            self.cache.issue()
        self.pending = []

    # -- the cache this controller runs, as engine.experts shows it ------------------------------------------------
    @property
    def n_slots(self) -> dict[int, int]:
        """Slots of each cached layer (layer -> slots)."""
        return self.cache.n_slots

    @property
    def chunk_bytes(self) -> dict[int, tuple[int, ...]]:
        """Bytes of each chunk of one expert per cached layer (expert_chunk_bytes)."""
        return self.cache.chunk_bytes

    def slots(self, layer: int) -> list[int] | None:
        """Slot of each expert of the layer (-1: not resident)."""
        return self.cache.slots(layer)

    def stats(self) -> dict[str, Any]:
        """The cache's counters (hits, misses, loads, ...) since the last reset_stats()."""
        return self.cache.stats()

    def reset_stats(self) -> None:
        self.cache.reset_stats()

    def mark(self, phase: str) -> None:
        """ExpertCache.mark: a generation's "start" and "decode", to split its hit rates."""
        self.cache.mark(phase)

    def prefill_stats(self) -> dict[str, Any] | None:
        return self.cache.prefill_stats()

    def precalc_stats(self) -> dict[str, Any] | None:
        return self.cache.precalc_stats()

    def set_precalc(self, first_layer: int | None, max_tokens: int = 1) -> None:
        """ExpertCache.set_precalc: DAOP's pre-calculation from first_layer on (None: off)."""
        self.cache.set_precalc(first_layer, max_tokens)

    def close(self) -> None:
        """Free the cache's slots (the engine does it before its context)."""
        self.cache.close()
