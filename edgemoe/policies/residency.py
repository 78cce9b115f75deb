"""Expert residency policies: which experts sit in each MoE layer's cache slots.

Pure Python over route ids (no ctypes), so they run the same on recorded traces
(`simulate`) and inside the engine (`edgemoe.runtime.expert_cache.CacheController`).
A policy answers with loads: copy expert e of layer l into slot s.

- ``static``: the most frequent experts per layer from a calibration
  (router_frequency.npz), loaded once, never changed.
- ``lru``: per-layer least-recently-used. On a miss the expert runs on the CPU
  for this step and is loaded for the next (Fiddler/DAOP); ``blocking`` loads it
  before the layer's experts run instead (mixtral-offloading), for comparison.
- ``manual``: no loads of its own (tests, external prefetchers).
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EdgeMoeError


class PolicyKind(str, enum.Enum):
    STATIC = "static"
    LRU = "lru"
    MANUAL = "manual"  # no automatic loads: the caller drives ExpertCache.load / prefetch


@dataclass(frozen=True)
class Load:
    layer: int
    expert: int
    slot: int


def used_experts(ids: np.ndarray) -> list[int]:
    """Experts a ubatch's (n_tokens, k) ids use, in first-use order (dropped slots, -1, left out)."""
    flat = np.asarray(ids).reshape(-1)
    _, first = np.unique(flat, return_index=True)
    return [int(flat[i]) for i in sorted(first) if flat[i] >= 0]


@dataclass
class StaticPolicy:
    """The n_slots most frequent experts of each layer, resident from the start."""

    frequency: Mapping[int, np.ndarray]  # layer -> (n_expert,) routing counts or shares
    n_slots: Mapping[int, int]  # layer -> slots
    blocking: bool = False  # unused: a static cache never loads after the start

    def initial_loads(self) -> list[Load]:
        loads = []
        for layer, n in self.n_slots.items():
            freq = np.asarray(self.frequency[layer], dtype=np.float64)
            top = np.argsort(-freq, kind="stable")[:n]  # ties: the lower expert id
            loads += [Load(layer, int(e), s) for s, e in enumerate(sorted(int(x) for x in top))]
        return loads

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        return []


@dataclass
class LruPolicy:
    """Per-layer LRU over the experts a step uses; starts empty."""

    n_slots: Mapping[int, int]  # layer -> slots
    blocking: bool = False  # load misses before the layer runs (True) or for the next step (False)
    _resident: dict[int, OrderedDict[int, int]] = field(default_factory=dict)  # layer -> expert -> slot, LRU first

    def initial_loads(self) -> list[Load]:
        return []

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        n = self.n_slots.get(layer, 0)
        if n <= 0:
            return []
        lru = self._resident.setdefault(layer, OrderedDict())
        before = dict(lru)
        used = used_experts(ids)
        for e in used:  # hits first: this step's misses evict experts the step does not use
            if e in lru:
                lru.move_to_end(e)
        for e in used:
            if e in lru:
                continue
            if len(lru) < n:
                slot = min(set(range(n)) - set(lru.values()))
            else:
                _, slot = lru.popitem(last=False)
            lru[e] = slot
        # a ubatch with more misses than slots evicts some of its own loads: copy only the survivors
        return [Load(layer, e, s) for e, s in lru.items() if before.get(e) != s]

    def resident(self, layer: int) -> set[int]:
        return set(self._resident.get(layer, {}))

    def reseed(self, slots: Mapping[int, Sequence[int]]) -> None:
        """Start over from what is resident: layer -> slot of each expert (-1: absent); LRU order = slot order."""
        self._resident = {layer: OrderedDict(sorted(((e, s) for e, s in enumerate(per) if s >= 0),
                                                    key=lambda es: es[1]))
                          for layer, per in slots.items()}


@dataclass
class ManualPolicy:
    """Loads nothing by itself (the API user, or an external prefetcher, places experts)."""

    n_slots: Mapping[int, int]
    blocking: bool = False

    def initial_loads(self) -> list[Load]:
        return []

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        return []


ResidencyPolicy = StaticPolicy | LruPolicy | ManualPolicy


def load_frequency(calibration: Path, *, n_expert: int | None = None,
                   layers: Sequence[int] | None = None) -> dict[int, np.ndarray]:
    """Per-layer routing counts from a calibration's router_frequency.npz; with n_expert / layers,
    refuses counts of another model (another expert count, or MoE layers it lacks)."""
    path = calibration / "router_frequency.npz"
    if not path.exists():
        raise EdgeMoeError(f"{path} is missing: run `edgemoe calibrate MODEL --stage router_frequency` "
                           "(the static policy places the most frequent experts)")
    d = np.load(path)
    freq = {int(layer): d["counts"][i] for i, layer in enumerate(d["layers"])}
    width = {int(c.shape[-1]) for c in freq.values()}
    missing = sorted(set(layers or ()) - set(freq))
    if (n_expert is not None and width != {n_expert}) or missing:
        what = (f"counts for {sorted(width)} experts per layer, the model has {n_expert}"
                if n_expert is not None and width != {n_expert} else f"no counts for MoE layers {missing}")
        raise EdgeMoeError(f"{path} is of another model ({what}): run `edgemoe calibrate MODEL --corpus FILE` "
                           "for this model, or pass its --calibration DIR")
    return freq


def make_policy(kind: str, n_slots: Mapping[int, int], *, blocking: bool = False,
                calibration: Path | None = None, n_expert: int | None = None) -> ResidencyPolicy:
    try:
        k = PolicyKind(kind)
    except ValueError:
        raise EdgeMoeError(f"unknown cache policy {kind!r}: use one of "
                           f"{', '.join(p.value for p in PolicyKind)}") from None
    if k is PolicyKind.LRU:
        return LruPolicy(dict(n_slots), blocking=blocking)
    if k is PolicyKind.MANUAL:
        return ManualPolicy(dict(n_slots))
    if calibration is None:
        raise EdgeMoeError("the static policy needs a calibration with router frequencies: "
                           "run `edgemoe calibrate MODEL --corpus FILE` or pass --calibration DIR")
    return StaticPolicy(load_frequency(calibration, n_expert=n_expert, layers=list(n_slots)), dict(n_slots))


@dataclass
class SimResult:
    hits: int = 0  # routed slots that found their expert resident
    misses: int = 0
    loads: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def simulate(policy: ResidencyPolicy, steps: Iterable[Sequence[tuple[int, np.ndarray]]]) -> SimResult:
    """Replay steps (each a list of (layer, ids) in layer order) as the engine runs them.

    Counts hits per routed slot against the residency the experts run with: a blocking
    policy's loads apply before the layer, a non-blocking one's after the step.
    """
    res = SimResult()
    resident: dict[int, dict[int, int]] = {}  # layer -> expert -> slot

    def apply(loads: list[Load]) -> None:
        for ld in loads:
            slots = resident.setdefault(ld.layer, {})
            for e in [e for e, s in slots.items() if s == ld.slot or e == ld.expert]:
                del slots[e]
            slots[ld.expert] = ld.slot
        res.loads += len(loads)

    apply(policy.initial_loads())
    for step in steps:
        pending: list[Load] = []
        for layer, ids in step:
            loads = policy.on_route(layer, ids)
            if policy.blocking:
                apply(loads)
            else:
                pending += loads
            flat = np.asarray(ids).reshape(-1)
            flat = flat[flat >= 0]
            hit = np.isin(flat, list(resident.get(layer, {})))
            if policy.n_slots.get(layer, 0) > 0:
                res.hits += int(hit.sum())
                res.misses += int((~hit).sum())
        apply(pending)
    return res
