"""The promoe policy: ProMoE's prefetcher over an LRU (policies.promoe.PromoePolicy); it needs a predictor, so the
engine builds it through the spec's `prefetch`, inside llama.cpp (the predictor in the graph) or in the hook."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...errors import EdgeMoeError, InvalidConfigError
from ..promoe import PROMOE_DISTANCE, PROMOE_EXTRA, PromoePolicy, distance_refusal
from ..registry import PolicyInputs, PolicySpec, PrefetchInputs, RequestOption, register
from .copy_queue_options import CopyQueueOptions

FOREIGN = "`prefetch_distance` and `prefetch_extra` are options of `policy='promoe'`"


@dataclass(frozen=True)
class PromoeConfig(CopyQueueOptions):
    """ProMoE's prefetcher over an LRU (policies.promoe.PromoePolicy)."""

    name: ClassVar[str] = "promoe"
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

    @property
    def prefetcher(self) -> bool:
        return True

    def prefetch_predictor(self) -> tuple[str, int, Path | None] | None:
        return (self.predictor, self.distance, self.calibration)


def _build(config: PromoeConfig, inputs: PolicyInputs) -> Any:
    raise EdgeMoeError(
        "the promoe policy needs an expert predictor: build edgemoe.policies.promoe.PromoePolicy "
        "(the engine does so from CacheConfig(slots, policy=PromoeConfig(calibration=DIR)))"
    )


def _prefetch(config: PromoeConfig, inputs: PrefetchInputs) -> PromoePolicy:
    return PromoePolicy(
        inputs.slots,
        inputs.layers,
        inputs.predictor,
        extra=config.extra,
        blocking=config.blocking,
        timing=config.admitted_timing,
    )


SPEC = register(
    PolicySpec(
        name="promoe",
        config=PromoeConfig,
        help="ProMoE's prefetcher: at each MoE layer the calibration's predictor names the experts of the layer "
        "`prefetch_distance` ahead, which are copied before it runs; an LRU otherwise; inside llama.cpp, the "
        "predictor in the graph, stopping at each cached layer",
        build=_build,
        options=(
            RequestOption("prefetch_distance", "distance", FOREIGN),
            RequestOption("prefetch_extra", "extra", FOREIGN),
        ),
        stages=("predictors",),
        replay_as="lru",  # its replacement is an LRU; the routing trace keeps no router inputs to predict from
        projected=False,  # the performance model has no prefetcher
        prefetch=_prefetch,
        in_graph_predictor=True,
    )
)
