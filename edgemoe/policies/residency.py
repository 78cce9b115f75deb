"""Expert residency policies: which experts sit in each MoE layer's cache slots.

Pure Python over route ids (no ctypes), so they run the same on recorded traces
(`replay_policy`) and inside the engine (`edgemoe.runtime.expert_cache.CacheController`).
A policy answers with loads: copy expert e of layer l into slot s.

- ``static``: the most frequent experts per layer from a calibration
  (router_frequency.npz), loaded once, never changed.
- ``lru``: per-layer least-recently-used. On a miss the expert runs on the CPU
  for this step and is loaded for the next (Fiddler/DAOP); ``blocking`` loads it
  before the layer's experts run instead (mixtral-offloading), for comparison.
- ``dali``: DALI's workload-aware replacement (Zhu et al., §4.3, Algorithm 2): per layer, the
  experts' workloads (tokens routed to each) are summed over a window of w tokens; at the end of
  each window the u highest-scoring experts outside the cache replace the u lowest-scoring inside
  it, and the scores restart from zero.
- ``daop``: DAOP's data-aware placement (Zhang et al., §IV-A/B, Algorithm 1): the calibration's most used
  decode-phase experts, then once per prompt the prompt's most used CPU experts swap with the least used
  GPU ones (edgemoe.policies.daop).
- ``manual``: no loads of its own (tests, external prefetchers).
- ``promoe``: ProMoE's prefetcher, in edgemoe.policies.promoe (it needs a predictor and the router inputs).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EdgeMoeError
from .counters import ReplayResult
from .daop import DAOP_SWAP_THRESHOLD, swap_pairs
from .loads import Load as Load  # re-exported: they lived here before loads.py
from .loads import Residency, split_loads
from .loads import used_experts as used_experts
from .registry import PolicyInputs, policy_config, policy_spec


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
    _resident: dict[int, OrderedDict[int, int]] = field(
        default_factory=dict
    )  # layer -> expert -> slot, LRU first

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
        self._resident = {
            layer: OrderedDict(sorted(((e, s) for e, s in enumerate(per) if s >= 0), key=lambda es: es[1]))
            for layer, per in slots.items()
        }


DALI_WINDOW = 4  # w_size: tokens per window (the paper's choice for every model it runs)
# u_size = ceil(n_expert / 8): the paper's 1 of Mixtral's 8 experts, 8 of DeepSeek's 64 and of Qwen's 60
DALI_UPDATE_SHARE = 8


def dali_default_update(n_expert: int) -> int:
    """The paper's u_size for a model with n_expert routed experts per layer (1 for 8, 8 for 60 or 64)."""
    return max(1, math.ceil(n_expert / DALI_UPDATE_SHARE))


@dataclass
class DaliPolicy:
    """DALI's workload-aware replacement, per layer.

    Scores are the tokens routed to each expert since the window began (a prefill ubatch of n
    tokens counts n). Once a window has seen ``window`` tokens (checked after each ubatch), the
    ``update`` non-resident experts with the highest scores replace the resident ones with the
    lowest, pair by pair while the newcomer's score is strictly higher (the paper swaps all u; a
    swap that does not raise the score only costs a copy), and the scores restart. Ties go to the
    lower expert id. The paper starts from random experts; this cache starts empty, so until a
    layer's slots are full its misses also fill the free ones (most routed tokens first, then the
    order of first use).
    """

    n_slots: Mapping[int, int]  # layer -> slots
    n_expert: int
    window: int = DALI_WINDOW  # w_size (tokens)
    update: int = 1  # u_size (experts swapped per window); make_policy's default: dali_default_update
    blocking: bool = False  # load before the layer runs (True) or for the next step (False)
    _resident: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> expert -> slot
    _scores: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (n_expert,) tokens this window
    _tokens: dict[int, int] = field(default_factory=dict)  # layer -> tokens this window

    def __post_init__(self) -> None:
        if self.window < 1 or self.update < 1:
            paper = f"window {DALI_WINDOW}, update {dali_default_update(self.n_expert)}"
            raise EdgeMoeError(
                f"dali window {self.window} and update {self.update}: both must be >= 1 "
                f"(the paper uses {paper})"
            )

    def initial_loads(self) -> list[Load]:
        return []

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        n = self.n_slots.get(layer, 0)
        if n <= 0:
            return []
        flat = np.asarray(ids).reshape(-1)
        counts = np.bincount(flat[flat >= 0], minlength=self.n_expert)
        scores = self._scores.setdefault(layer, np.zeros(self.n_expert, np.int64))
        scores += counts
        res = self._resident.setdefault(layer, {})
        loads: list[Load] = []
        if len(res) < n:  # warm-up: misses fill the free slots
            used = used_experts(ids)
            misses = sorted((e for e in used if e not in res), key=lambda e: (-counts[e], used.index(e)))
            free = sorted(set(range(n)) - set(res.values()))
            for e, s in zip(misses, free, strict=False):
                res[e] = s
                loads.append(Load(layer, e, s))
        self._tokens[layer] = self._tokens.get(layer, 0) + int(np.asarray(ids).shape[0])
        if self._tokens[layer] >= self.window:
            loads += self._replace(layer, scores, res)
            scores[:] = 0
            self._tokens[layer] = 0
        return loads

    def _replace(self, layer: int, scores: np.ndarray, res: dict[int, int]) -> list[Load]:
        # the u best outside meet the u worst inside (ties: lower id), pair by pair while the newcomer scores higher
        loads = []
        for e_in, e_out in swap_pairs(scores, res, threshold=1.0, max_pairs=self.update):
            slot = res.pop(e_out)
            res[e_in] = slot
            loads.append(Load(layer, e_in, slot))
        return loads

    def resident(self, layer: int) -> set[int]:
        return set(self._resident.get(layer, {}))

    def reseed(self, slots: Mapping[int, Sequence[int]]) -> None:
        """Start over from what is resident (layer -> slot of each expert, -1: absent), the window empty."""
        self._resident = {layer: {e: s for e, s in enumerate(per) if s >= 0} for layer, per in slots.items()}
        self._scores.clear()
        self._tokens.clear()


@dataclass
class ManualPolicy:
    """Loads nothing by itself (the API user, or an external prefetcher, places experts)."""

    n_slots: Mapping[int, int]
    blocking: bool = False

    def initial_loads(self) -> list[Load]:
        return []

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        return []


# any registered policy's (a fifo written to a module of its own too): the protocol the classes above satisfy
ResidencyPolicy = Residency


def load_frequency(
    calibration: Path, *, n_expert: int | None = None, layers: Sequence[int] | None = None, phase: str = "all"
) -> dict[int, np.ndarray]:
    """Per-layer routing counts from a calibration's router_frequency.npz; with n_expert / layers,
    refuses counts of another model (another expert count, or MoE layers it lacks). phase "decode":
    the calibration's decode-phase counts (DAOP's placement), or all counts where it has none."""
    path = calibration / "router_frequency.npz"
    if not path.exists():
        raise EdgeMoeError(
            f"{path} is missing: run `edgemoe calibrate MODEL --stage router_frequency` "
            "(the static and daop policies place the most frequent experts)"
        )
    d = np.load(path)
    key = "decode_counts" if phase == "decode" and "decode_counts" in d.files else "counts"
    freq = {int(layer): d[key][i] for i, layer in enumerate(d["layers"])}
    width = {int(c.shape[-1]) for c in freq.values()}
    missing = sorted(set(layers or ()) - set(freq))
    if (n_expert is not None and width != {n_expert}) or missing:
        what = (
            f"counts for {sorted(width)} experts per layer, the model has {n_expert}"
            if n_expert is not None and width != {n_expert}
            else f"no counts for MoE layers {missing}"
        )
        raise EdgeMoeError(
            f"{path} is of another model ({what}): run `edgemoe calibrate MODEL --corpus FILE` "
            "for this model, or pass its `calibration`"
        )
    return freq


def make_policy(
    kind: str,
    n_slots: Mapping[int, int],
    *,
    blocking: bool = False,
    calibration: Path | None = None,
    n_expert: int | None = None,
    window: int = DALI_WINDOW,
    update: int | None = None,
    swap_threshold: float = DAOP_SWAP_THRESHOLD,
    frequency: Mapping[int, np.ndarray] | None = None,
) -> ResidencyPolicy:
    """The policy named `kind` over `n_slots` (layer -> slots), built by its registered spec from a record with
    those of the options it has. static and daop read `calibration`'s router frequencies (daop: of the decode
    phase, and it needs `n_expert`; `swap_threshold` is its SwapInOut); dali needs `n_expert` and takes its
    window / update (None: dali_default_update). `frequency` (layer -> router counts): what the policies that
    place by router frequencies (static, daop) place by instead of the calibration's."""
    spec = policy_spec(kind)
    given = {
        "blocking": blocking,
        "calibration": calibration,
        "window": window,
        "update": update,
        "threshold": swap_threshold,
    }
    config = policy_config(kind, **{k: v for k, v in given.items() if k in spec.option_names})
    return spec.build(config, PolicyInputs(dict(n_slots), n_expert, frequency))


def replay_policy(
    policy: ResidencyPolicy,
    steps: Iterable[Sequence[tuple[int, np.ndarray]]],
    counted: Iterable[bool] | None = None,
) -> ReplayResult:
    """Replay steps (each a list of (layer, ids) in layer order) as the engine runs them.

    Counts hits per routed slot against the residency the experts run with: a blocking
    policy's loads apply before the layer, a non-blocking one's after the step (an
    AssignedPolicy's: those it loads now before the layer, the others after the step). `counted`
    (one flag per step) leaves the other steps' hits, misses and loads out of the result
    (they still change the residency), e.g. to count decode steps only.
    """
    res = ReplayResult()
    resident: dict[int, dict[int, int]] = {}  # layer -> expert -> slot

    def apply(loads: list[Load], count: bool = True) -> None:
        for ld in loads:
            slots = resident.setdefault(ld.layer, {})
            for e in [e for e, s in slots.items() if s == ld.slot or e == ld.expert]:
                del slots[e]
            slots[ld.expert] = ld.slot
        if count:
            res.loads += len(loads)

    apply(policy.initial_loads())
    flags = iter(counted) if counted is not None else None
    for step in steps:
        count = True if flags is None else bool(next(flags))
        pending: list[Load] = []
        for layer, ids in step:
            now, later = split_loads(policy, policy.on_route(layer, ids))
            apply(now, count)
            pending += later
            flat = np.asarray(ids).reshape(-1)
            flat = flat[flat >= 0]
            hit = np.isin(flat, list(resident.get(layer, {})))
            if count and policy.n_slots.get(layer, 0) > 0:
                res.hits += int(hit.sum())
                res.misses += int((~hit).sum())
        apply(pending, count)
    return res
