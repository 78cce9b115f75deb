"""The engine side of the prefetching policies in the routing hook: promoe (ProMoE's prefetcher,
edgemoe.policies.promoe) and dali with its prefetcher (edgemoe.policies.dali_prefetch).

At each MoE layer's routing callback the controller hands the routed ids and the router input to a
`PolicyDriver` (edgemoe.policies.replay), which runs `PromoePolicy` over a `CacheModel` of this
cache and returns the native operations to make: prefetches with priorities, cancels (an empty
load into the slot: the native API has no other way to drop a queued load), issues and syncs. They
are made on llama.cpp's cache in the same order, so the model and the native cache hold the same
experts; an `issue` that sends another number of chunks than the model means they diverged and
raises. The counters (`report`) are the driver's: on the same routes and copy timing, `replay`
gives the same numbers.

In the hook the predictor runs in numpy on the host, once per MoE layer (a host sync per layer and a
Python call, as dali's hook). `NativePromoeController` runs promoe inside llama.cpp instead: the predictor runs in the graph and, at each cached layer's routing callback,
llama.cpp hands its ids to the loader and makes PromoePolicy's decisions itself, with no Python call;
`PromoeConfig.native` chooses (default: native where it can run).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

from ..errors import EdgeMoeError
from ..gguf.info import ModelInfo
from ..policies.copy_queue import CacheModel, CancelOp, IssueOp, NativeOp, PrefetchOp, SyncOp
from ..policies.kinds.copy_queue_options import CopyQueueOptions
from ..policies.prefetching import Prefetcher
from ..policies.registry import PrefetchInputs, spec_of
from ..policies.replay import PolicyDriver, PrefetchCounts
from ..policies.residency import Load
from ..policies.route import RouteRecord
from ..predictors.base import Predictor
from ..predictors.gate import GatePredictor
from ..predictors.store import load_calibrated, spec_for_model
from . import native
from .cache_config import CacheConfig, PromoeConfig
from .expert_cache import CacheController, ExpertCache, ExpertCacheError

log = logging.getLogger(__name__)


def prefetch_predictor(
    model: Path, calibration: Path | None, kind: str, distance: int, policy: str = "promoe"
) -> tuple[Predictor, str | None]:
    """The calibration's predictor of `kind` at `distance`, else gate reuse (it needs only the GGUF's routers);
    the second value says why it fell back (None when it did not)."""
    spec = spec_for_model(model)
    if calibration is not None:
        pred = load_calibrated(calibration, spec, kind, distance)
        if pred is not None:
            return pred, None
        why = f"{calibration} has no {kind} predictor at distance {distance}"
    else:
        why = f"{model.name} has no calibration"
    return GatePredictor(spec, distance), (
        f"{why}: {policy} predicts with the gate predictor (layer l+{distance}'s router on layer l's router input, "
        f"less accurate: docs/predictors.md); `edgemoe calibrate {model.name} --corpus FILE` trains the {kind} "
        "predictor"
    )


def prefetch_report(
    policy: Prefetcher, config: CopyQueueOptions, pc: PrefetchCounts, **where: Any
) -> dict[str, Any]:
    """The `prefetch` object of the cache's report: the counters, the policy's settings, where it runs."""
    timing = config.copy_timing
    return {
        "issued": pc.issued,
        "useful": pc.useful,
        "preempted": pc.preempted,
        "goodpred": pc.goodpred,
        "accuracy": pc.accuracy,
        "fetch_rate": pc.fetch_rate,
        "predictor": f"{policy.predictor.kind.value}-d{policy.distance}",
        "extra": policy.extra,
        "per_layer_cap": policy.prefetch_cap(1, 1 << 30),
        "admission": policy.timing is not None,
        "timing": timing.describe() if timing is not None else "every queued chunk at once",
        **where,
    }


class PrefetchController(CacheController):
    """Runs a prefetcher (its spec's `prefetch`: promoe, dali's) in the routing hook (a Python policy: llama.cpp calls
    back at every MoE layer)."""

    wants_gate_inp = True
    issues_own_loads = True  # its model of the copy queue counts the chunks it issues

    def __init__(
        self,
        cache: ExpertCache,
        policy: Prefetcher,
        config: CopyQueueOptions,
        *,
        alloc: str = "equal",
        note: str | None = None,
    ) -> None:
        super().__init__(cache, policy, alloc=alloc)
        self.prefetcher = policy
        self.driver = PolicyDriver(policy, CacheModel(cache.n_slots, cache.chunk_bytes), config.copy_timing)
        self.config = config
        self.note = note  # why the predictor is not the one asked for (None: it is)
        self.counting = True  # whether the next ubatches go into the counters (e.g. False while prefilling)
        self.hook_reason: str | None = None  # why promoe runs here and not inside llama.cpp (None: not asked)
        self._last_layer: int | None = None

    @property
    def needs_routes(self) -> bool:
        return True

    @property
    def native_policy(self) -> int:
        return native.MOE_CACHE_POLICY_CALLBACK

    def on_route(self, route: RouteRecord) -> None:
        if self._last_layer is None or route.layer <= self._last_layer:
            self.driver.begin_step(route.n_tokens, self.counting)
        self._last_layer = route.layer
        for op in self.driver.on_route(route.layer, route.ids, route.gate_inp):
            self._apply(op)

    def _apply(self, op: NativeOp) -> None:
        c = self.cache
        if isinstance(op, PrefetchOp):
            c.prefetch(op.load, op.priority)
        elif isinstance(op, CancelOp):
            c.cancel(op.layer, op.slot)
        elif isinstance(op, IssueOp):
            sent = c.issue(op.chunks)
            if sent != op.chunks:
                raise ExpertCacheError(
                    f"llama.cpp issued {sent} chunks where the prefetcher's model of its queue "
                    f"expected {op.chunks}: they no longer agree (a bug; please report it)"
                )
        elif isinstance(op, SyncOp):
            c.sync()
        elif isinstance(op, Load):
            c.load(op)

    def flush(self) -> None:
        """Nothing is left for after the ubatch: every load was queued and issued in its layer's hook."""

    def report(self) -> dict[str, Any]:
        pc = self.driver.result.prefetch  # the same as replaying this run's routes
        assert pc is not None  # a prefetcher's driver counts its prefetches
        return {
            **super().report(),
            "prefetch": prefetch_report(self.prefetcher, self.config, pc, path="hook"),
        }


class NativePromoeController(CacheController):
    """Runs promoe's prefetcher inside llama.cpp (LLAMA_MOE_CACHE_POLICY_PROMOE, predicted prefetch) with the predictor in the
    graph: the same decisions at the same routing callbacks, no Python per layer. The engine sets the predictor
    (set_predictors) and takes it out with the cache."""

    def __init__(
        self,
        cache: ExpertCache,
        policy: Prefetcher,
        config: PromoeConfig,
        *,
        alloc: str = "equal",
        note: str | None = None,
    ) -> None:
        super().__init__(cache, policy, alloc=alloc)
        self.prefetcher = policy
        self.config = config
        self.note = note  # why the predictor is not the one asked for (None: it is)

    @property
    def needs_routes(self) -> bool:
        return False

    @property
    def native_policy(self) -> int:
        return native.MOE_CACHE_POLICY_PREDICTED_PREFETCH

    def set_mode(self, policy: int) -> None:
        """Always native: a routing hook (gating, the user's policies) runs before it in the same callback. Every
        load is admitted (admit_bytes 0): llama.cpp can refuse the loads that cannot arrive in time, but that needs
        a copy stream's measured bandwidth and layer time, which only a GPU gives (and copy_timing, the stand-in's
        model of one, runs in the hook)."""
        if self.mode == native.MOE_CACHE_POLICY_PREDICTED_PREFETCH:
            return
        native.moe_cache_set_predicted_prefetch(self.cache._ctx, self.policy.blocking, 0.0)
        super().set_mode(native.MOE_CACHE_POLICY_PREDICTED_PREFETCH)

    def graph_predictors(self) -> tuple[list[Predictor], int, Any] | None:
        """The predictor the graph evaluates for it, the experts per token it prefetches, the weights' type."""
        p = self.prefetcher
        return [p.predictor], p.per_token, self.config.weights

    def report(self) -> dict[str, Any]:
        pc = PrefetchCounts(**native.moe_cache_prefetch_stats(self.cache._ctx))
        return {
            **super().report(),
            "prefetch": prefetch_report(
                self.prefetcher,
                self.config,
                pc,
                path="native",
                weights=self.config.weights,
                predictor_bytes=native.moe_predictor_bytes(self.cache._ctx),
            ),
        }


def native_promoe_refusal(config: PromoeConfig, policy: Prefetcher, info: ModelInfo) -> str | None:
    """Why promoe cannot run inside llama.cpp with this configuration (None: it can)."""
    if config.native is False:
        return "asked for the routing hook (native=False)"
    timing = config.copy_timing
    if timing is not None and not timing.infinite:
        return "a copy timing paces the stand-in's copies, which only the hook's model of the queue does"
    spec = policy.predictor.spec
    if 2 * spec.k > info.n_expert:
        return f"{spec.k} of {info.n_expert} experts per token: the routing callback's cache needs 2k <= n_expert"
    return None


def make_prefetcher(cache: ExpertCache, config: CacheConfig, model: Path, info: ModelInfo) -> CacheController:
    """The controller of a policy whose spec builds a prefetcher (promoe, dali with a prefetch size) over `cache`:
    the calibration's predictor (gate reuse without one); inside llama.cpp where its spec can put the predictor in
    the graph and the configuration allows it, else in the routing hook."""
    p = config.policy
    spec = spec_of(p)
    wanted = p.prefetch_predictor()
    if spec.prefetch is None or wanted is None:
        raise EdgeMoeError(f"the {p.name} policy has no prefetcher: use promoe, or dali with a prefetch size")
    kind, distance, calibration = wanted
    pred, note = _logged_predictor(model, calibration, kind, distance, p.name)
    policy = spec.prefetch(p, PrefetchInputs(cache.n_slots, list(info.moe_layers), pred, info.n_expert))
    queue = cast(CopyQueueOptions, p)  # the records of the policies with a prefetcher
    if not spec.in_graph_predictor:
        return PrefetchController(cache, policy, queue, alloc=config.alloc, note=note)
    p = cast(PromoeConfig, p)  # the one policy whose predictor runs in the graph
    why = native_promoe_refusal(p, policy, info)
    if why is None:
        return NativePromoeController(cache, policy, p, alloc=config.alloc, note=note)
    if p.native:
        raise EdgeMoeError(f"promoe cannot run inside llama.cpp here: {why}")
    log.info("promoe runs in the routing hook: %s", why)
    ctl = PrefetchController(cache, policy, p, alloc=config.alloc, note=note)
    ctl.hook_reason = why
    return ctl


def _logged_predictor(
    model: Path, calibration: Path | None, kind: str, distance: int, policy: str
) -> tuple[Predictor, str | None]:
    """prefetch_predictor, its fallback note logged."""
    pred, note = prefetch_predictor(model, calibration, kind, distance, policy)
    if note:
        log.info("%s", note)
    return pred, note
