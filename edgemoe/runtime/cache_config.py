"""The expert cache's configuration: `CacheConfig` holds what every policy shares (slots, overlap, loads,
prefill, pre-calculation), and one frozen record per residency policy holds that policy's own options.
`policy_config(name, **options)` builds the record of a policy named on a command line (docs/expert-cache.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from ..errors import EdgeMoeError, InvalidConfigError
from ..policies.assignment import assign_refusal
from ..policies.copy_queue import CopyTiming, load_worker_default
from ..policies.dali_prefetch import dali_prefetch_refusal
from ..policies.daop import DAOP_SWAP_THRESHOLD
from ..policies.promoe import PROMOE_DISTANCE, PROMOE_EXTRA, distance_refusal
from ..policies.residency import DALI_WINDOW, PolicyKind
from . import native


class ExpertCacheError(EdgeMoeError):
    """The expert cache cannot be set up for this model or configuration."""


def _refuse_assign(policy: str, assign: str | None, *, blocking: bool, prefetcher: bool) -> None:
    if assign is not None:
        refusal = assign_refusal(policy, blocking=blocking, prefetcher=prefetcher)
        if refusal is not None:
            raise InvalidConfigError(refusal)


@dataclass(frozen=True)
class StaticConfig:
    """The calibration's most used experts, loaded once (residency.StaticPolicy)."""

    name: ClassVar[str] = PolicyKind.STATIC.value
    calibration: Path | None = None  # where router_frequency.npz is


@dataclass(frozen=True)
class ManualConfig:
    """No loads of its own: the caller drives ExpertCache.load / prefetch."""

    name: ClassVar[str] = PolicyKind.MANUAL.value


@dataclass(frozen=True)
class LruConfig:
    """Per-layer least-recently-used (residency.LruPolicy)."""

    name: ClassVar[str] = PolicyKind.LRU.value
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step
    # per route, a CPU/GPU assigner (edgemoe.policies.assignment: "ratio", "greedy") decides which of the
    # policy's loads to make before the layer runs (computed on the GPU this step) rather than for its next run
    # (the miss on the CPU); needs assign_costs (edgemoe.perf.costmodel.expert_costs from a profile). Runs in
    # the routing hook: a host sync per MoE layer
    assign: str | None = None
    assign_costs: Mapping[int, Any] | None = None  # MoE layer -> edgemoe.policies.assignment.ExpertCosts

    def __post_init__(self) -> None:
        _refuse_assign(self.name, self.assign, blocking=self.blocking, prefetcher=False)


@dataclass(frozen=True)
class _CopyQueue:
    """The options of a prefetcher's model of the copy queue (promoe, dali's prefetcher)."""

    # how many chunks the copy queue issues after each MoE layer (None: every queued chunk, as a copy stream
    # that keeps up); a model of a slower stream for the stand-in, whose copies are instant
    copy_timing: CopyTiming | None = None
    # with a copy_timing: queue only the loads that can arrive in time (False: ProMoE's rule, every prediction)
    admission: bool = True

    @property
    def admitted_timing(self) -> CopyTiming | None:
        """The timing the prefetcher admits its loads by (None: every prediction)."""
        return self.copy_timing if self.admission else None


@dataclass(frozen=True)
class DaliConfig(_CopyQueue):
    """DALI's workload-aware replacement (residency.DaliPolicy), optionally with its residual prefetcher."""

    name: ClassVar[str] = PolicyKind.DALI.value
    window: int = DALI_WINDOW  # tokens per window (w)
    update: int | None = None  # experts replaced per window (u); None: the paper's for the model
    # experts of the next MoE layer its residual predictor prefetches per layer (DALI's prefetch size,
    # edgemoe.policies.dali_prefetch); 0: replacement only, which runs natively
    prefetch: int = 0
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step
    assign: str | None = None  # as LruConfig.assign (not with the prefetcher)
    assign_costs: Mapping[int, Any] | None = None
    calibration: Path | None = None  # the prefetcher's residual predictor (gate reuse without one)

    def __post_init__(self) -> None:
        if self.prefetch:
            refusal = dali_prefetch_refusal(self.name, blocking=self.blocking)
            if refusal is not None:
                raise InvalidConfigError(refusal)
        _refuse_assign(self.name, self.assign, blocking=self.blocking, prefetcher=self.prefetch > 0)


@dataclass(frozen=True)
class DaopConfig:
    """DAOP's data-aware placement (policies.daop.DaopPolicy): static plus a swap per prompt."""

    name: ClassVar[str] = PolicyKind.DAOP.value
    calibration: Path | None = None  # where the decode-phase router frequencies are
    threshold: float = DAOP_SWAP_THRESHOLD  # SwapInOut: a prompt's expert swaps in above this ratio
    blocking: bool = False  # swap before the layer runs instead of after the step


@dataclass(frozen=True)
class PromoeConfig(_CopyQueue):
    """ProMoE's prefetcher over an LRU (policies.promoe.PromoePolicy)."""

    name: ClassVar[str] = PolicyKind.PROMOE.value
    calibration: Path | None = None  # where the predictors are (gate reuse without them)
    distance: int = PROMOE_DISTANCE  # predict MoE layer l+d at layer l
    extra: int = PROMOE_EXTRA  # prefetch the top-(k+m) predicted experts
    predictor: str = "mlp"  # the calibration's predictor kind (gate when it has none)
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step
    # inside llama.cpp (the in-graph predictor's ids drive the loads, no Python per layer) or in the routing
    # hook (False); None: inside where it can run (no copy_timing pacing the stand-in, at most n_expert/2
    # experts per token), else the hook; True: inside or an error
    native: bool | None = None
    # inside llama.cpp: how the predictor's matrices are stored in the graph (edgemoe.runtime.prediction's
    # WEIGHT_TYPES: "f32" computes as the numpy predictor does; "f16" holds a calibration's float16 weights
    # exactly, with the router input rounded to f16; "q8_0" takes about half of f16's bytes)
    weights: str = "f16"

    def __post_init__(self) -> None:
        refusal = distance_refusal(self.distance)
        if refusal is not None:
            raise InvalidConfigError(refusal)


PolicyConfig = StaticConfig | ManualConfig | LruConfig | DaliConfig | DaopConfig | PromoeConfig
POLICY_CONFIGS: dict[PolicyKind, type[PolicyConfig]] = {
    PolicyKind.STATIC: StaticConfig,
    PolicyKind.LRU: LruConfig,
    PolicyKind.DALI: DaliConfig,
    PolicyKind.DAOP: DaopConfig,
    PolicyKind.MANUAL: ManualConfig,
    PolicyKind.PROMOE: PromoeConfig,
}


def policy_options(name: str) -> tuple[str, ...]:
    """The options of the policy named `name` (its config record's fields)."""
    return tuple(f.name for f in fields(POLICY_CONFIGS[_kind(name)]))


def _kind(name: str) -> PolicyKind:
    try:
        return PolicyKind(name)
    except ValueError:
        raise InvalidConfigError(
            f"unknown cache policy {name!r}: use one of {', '.join(p.value for p in PolicyKind)}"
        ) from None


def policy_config(name: str, **options: Any) -> PolicyConfig:
    """The config record of the policy named `name` with `options` (its fields) set; an unknown name or an option
    the policy does not have raises InvalidConfigError."""
    cls = POLICY_CONFIGS[_kind(name)]
    has = policy_options(name)
    unknown = sorted(set(options) - set(has))
    if unknown:
        raise InvalidConfigError(
            f"the {name} policy has no option {unknown[0]!r} "
            f"({'its options: ' + ', '.join(has) if has else 'it has none'})"
        )
    return cls(**options)


def calibrated_config(name: str, calibration: Path | None, **options: Any) -> PolicyConfig:
    """policy_config(name, **options) with the model's calibration directory where the policy reads one (static,
    daop: router frequencies; promoe, dali's prefetcher: predictors); lru and manual read none."""
    if "calibration" in policy_options(name):
        options["calibration"] = calibration
    return policy_config(name, **options)


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

    @property
    def prefetcher(self) -> bool:
        """Does a prefetcher run this cache from the routing hook (promoe, dali with a prefetch size)?"""
        p = self.policy
        return isinstance(p, PromoeConfig) or (isinstance(p, DaliConfig) and p.prefetch > 0)

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
            f"--expert-slots {n}{where}: use 0..{n_expert} (the model has {n_expert} experts per layer)"
        )
    return per
