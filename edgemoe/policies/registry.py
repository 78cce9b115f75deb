"""The residency-policy registry: one `PolicySpec` per policy name, filled by `register` in each policy's module.

A spec says everything the rest of edgemoe asks of a policy: its config record, how to build it, its all-sizes
replay for the DP allocation, the calibration stages it reads, the step that runs it inside llama.cpp (or none),
the request options that belong to it, its help text. Nothing outside a policy's own module tests its name.
The kind modules (edgemoe.policies.kinds) import this module, never the reverse; edgemoe.policies imports every
kind, so the registry is complete as soon as anything in the package is imported (docs/adding-a-policy.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from ..errors import InvalidConfigError
from ..predictors.base import Predictor
from .loads import Residency
from .prefetching import Prefetcher


@dataclass(frozen=True)
class PolicyRecord:
    """The base of every policy's frozen config record: `name` (its registry key) and its own options as fields.
    The methods answer the questions other layers would otherwise ask by the policy's name."""

    name: ClassVar[str]

    @property
    def prefetcher(self) -> bool:
        """Does a prefetcher run it from the routing hook (built by its spec's `prefetch`)?"""
        return False

    def assignment(self) -> tuple[str, Mapping[int, Any] | None] | None:
        """(its CPU/GPU assigner, the assigner's costs) where it takes one and one is set, else None."""
        return None

    def request_refusal(self) -> str | None:
        """A rule only the user's request applies (the engine's API leaves it to the policy), or None."""
        return None

    def hook_option(self) -> str | None:
        """The request option that makes it run in the routing hook (refused with --precalc-from), or None."""
        return None

    def prefetch_predictor(self) -> tuple[str, int, Path | None] | None:
        """The predictor its prefetcher reads: (kind, distance, the calibration it is stored in), or None."""
        return None

    def extra_calibration(self) -> tuple[str, tuple[str, ...]] | None:
        """(the option that needs it, stages) of a calibration its options need beyond the spec's stages."""
        return None

    def allocation_options(self) -> dict[str, Any]:
        """Its options that edgemoe.calibration.slot_alloc.allocate_slots's replay takes."""
        return {}

    def replay_key(self, n_expert: int) -> dict[str, Any]:
        """Its options that change its replay, resolved for a model of n_expert experts (the dp curves' cache key)."""
        return {}


@dataclass(frozen=True)
class PolicyInputs:
    """What building a policy reads besides its record."""

    slots: Mapping[int, int]  # layer -> slots
    n_expert: int | None = None  # routed experts per layer (None: unknown; the policies that need it say so)
    # layer -> router counts (n_expert,) to place by instead of the record's calibration (replays, simulations)
    frequency: Mapping[int, np.ndarray] | None = None


@dataclass(frozen=True)
class LayerReplay:
    """One layer's steps for an all-sizes replay (edgemoe.policies.allocation.replay_curve)."""

    steps: Sequence[np.ndarray]  # (n_tokens, k) ids per step, -1: dropped
    flags: np.ndarray  # (n_steps,) the counted steps
    max_slots: int
    n_expert: int
    frequency: np.ndarray | None = None  # (n_expert,) the layer's router counts (spec.frequency_phase)


@dataclass(frozen=True)
class PrefetchInputs:
    """What building a prefetcher reads besides its record."""

    slots: Mapping[int, int]  # layer -> slots
    layers: Sequence[int]  # the model's MoE layers
    predictor: Predictor  # the one its record asks for (prefetch_predictor), or gate reuse
    n_expert: int


@dataclass(frozen=True)
class NativeStep:
    """How llama.cpp runs a policy in the graph: its per-ubatch step (a key of runtime.native.MOE_CACHE_STEPS:
    "manual", "lru", "window_replacement", "prompt_swap") and the parameters its setter takes."""

    step: str
    params: tuple[float, ...] = ()
    what: str = ""  # the parameters in words, for llama.cpp's refusal


@dataclass(frozen=True)
class RequestOption:
    """A request keyword (a CLI flag) that sets a field of one policy's record."""

    keyword: str  # edgemoe.placement.cache_request's keyword, e.g. "dali_window"
    field: str  # the record's field, e.g. "window"
    foreign: str  # the refusal when the request names another policy
    unset: tuple[object, ...] = (None,)  # the values that mean "not given"


R = TypeVar("R", bound=PolicyRecord)  # a policy's config record
P = TypeVar("P", bound=Residency)  # the residency policy its spec builds
Build = Callable[[R, PolicyInputs], P]  # (record, inputs) -> the residency policy
AllSizes = Callable[
    [R, LayerReplay], tuple[np.ndarray, np.ndarray]
]  # -> (misses, loads) for t = 0..max_slots
Native = Callable[[R, P], "NativeStep | None"]  # (record, policy) -> its step in the graph
Prefetch = Callable[[R, PrefetchInputs], Prefetcher]  # (record, inputs) -> its prefetcher


@dataclass(frozen=True)
class PolicySpec(Generic[R, P]):
    """One residency policy as the rest of edgemoe sees it, typed by its config record R and its policy P."""

    name: str
    config: type[R]  # its frozen config record
    help: str  # one clause of --policy's help
    build: Build[R, P]  # raises EdgeMoeError with what to pass where it cannot build from the inputs
    options: tuple[RequestOption, ...] = ()  # the request's options that are its own
    stages: tuple[str, ...] = ()  # calibration stages it always reads (edgemoe.calibration.stages)
    frequency_phase: str | None = None  # it places by router counts of this phase ("all", "decode")
    all_sizes: AllSizes[R] | None = None  # its exact vectorised replay for every slot count
    replay_as: str | None = None  # the policy whose replay stands for it in the dp allocation
    replayable: bool = True  # False: it loads nothing by itself, so there is nothing to replay
    projected: bool = True  # the performance model (perf.model.simulate) can replay it (not a prefetcher)
    native: Native[R, P] | None = (
        None  # its step inside llama.cpp's graph (None: it runs in the routing hook)
    )
    # the prefetcher family: its prefetcher, run by the engine's prefetch controllers (None: not one)
    prefetch: Prefetch[R] | None = None
    in_graph_predictor: bool = (
        False  # its prefetcher can run inside llama.cpp with the predictor in the graph
    )
    compared: int = 0  # bench and simulate run it when no --policy is given, in this order (0: they do not)

    @property
    def option_names(self) -> tuple[str, ...]:
        """Its record's fields (the options policy_config takes)."""
        return tuple(f.name for f in fields(self.config))

    @property
    def prefetches(self) -> bool:
        """It is of the prefetcher family: its record may ask for a prefetcher (PolicyRecord.prefetcher)."""
        return self.prefetch is not None

    @property
    def loads_misses(self) -> bool:
        """It loads from the routes it sees (so --blocking-loads has a miss to load, and the cache needs the
        routes); static and manual never do."""
        return "blocking" in self.option_names

    @property
    def assignable(self) -> bool:
        """A CPU/GPU assigner (--assign) can pick which of its loads run now."""
        return "assign" in self.option_names


_REGISTRY: dict[str, PolicySpec[Any, Any]] = {}
UNKNOWN = "unknown cache policy {name!r}: use one of {names}"


def register(spec: PolicySpec[R, P]) -> PolicySpec[R, P]:
    """Make spec.name run spec (its record's `name` must be the same)."""
    if spec.config.name != spec.name:
        raise ValueError(
            f"policy {spec.name!r}: its record {spec.config.__name__} is named {spec.config.name!r}"
        )
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a policy (tests that register one of their own)."""
    _REGISTRY.pop(name, None)


def policy_names() -> tuple[str, ...]:
    """Every registered policy, in registration order."""
    return tuple(_REGISTRY)


def policy_spec(name: str) -> PolicySpec[Any, Any]:
    """The spec of the policy named `name`; an unknown name raises InvalidConfigError naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidConfigError(UNKNOWN.format(name=name, names=", ".join(_REGISTRY))) from None


def _compared_first(names: list[str]) -> tuple[str, ...]:
    """`names` with the compared policies first, in their order, then the others in registration order."""
    return tuple(sorted(names, key=lambda n: (_REGISTRY[n].compared == 0, _REGISTRY[n].compared)))


def benched_policies() -> tuple[str, ...]:
    """The policies `edgemoe bench` can run against stock: those that load experts by themselves (not manual),
    the compared ones first."""
    return _compared_first([n for n in _REGISTRY if _REGISTRY[n].replayable])


def projected_policies() -> tuple[str, ...]:
    """The policies the performance model replays (`edgemoe simulate`, `edgemoe plan`): not the prefetchers."""
    return tuple(n for n in benched_policies() if _REGISTRY[n].projected)


def compared_policies() -> tuple[str, ...]:
    """What bench and simulate compare with stock when no policy is named (the specs marked `compared`)."""
    return _compared_first([n for n in _REGISTRY if _REGISTRY[n].compared])


def spec_of(config: R) -> PolicySpec[R, Any]:
    """The spec of the policy a config record describes."""
    return policy_spec(config.name)


def policy_options(name: str) -> tuple[str, ...]:
    """The options of the policy named `name` (its config record's fields)."""
    return policy_spec(name).option_names


def policy_config(name: str, **options: Any) -> PolicyRecord:
    """The config record of the policy named `name` with `options` (its fields) set; an unknown name or an option
    the policy does not have raises InvalidConfigError."""
    spec = policy_spec(name)
    has = spec.option_names
    unknown = sorted(set(options) - set(has))
    if unknown:
        raise InvalidConfigError(
            f"the {name} policy has no option {unknown[0]!r} "
            f"({'its options: ' + ', '.join(has) if has else 'it has none'})"
        )
    return spec.config(**options)


def calibrated_config(name: str, calibration: Path | None, **options: Any) -> PolicyRecord:
    """policy_config(name, **options) with the model's calibration directory where the policy reads one (static,
    daop: router frequencies; promoe, dali's prefetcher: predictors); lru and manual read none."""
    if "calibration" in policy_options(name):
        options["calibration"] = calibration
    return policy_config(name, **options)


def completed(
    config: PolicyRecord, *, calibration: Path | None, assign_costs: Mapping[int, Any] | None
) -> PolicyRecord:
    """`config` with the calibration directory and the assigner's costs set where its policy reads them."""
    has = spec_of(config).option_names
    given = {"calibration": calibration, "assign_costs": assign_costs}
    return replace(config, **{k: v for k, v in given.items() if k in has})
