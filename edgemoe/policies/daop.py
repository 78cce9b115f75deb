"""DAOP's data-aware expert placement (Zhang, Aggarwal, Mitra, "DAOP: Data-Aware Offloading and Predictive
Pre-Calculation for Efficient MoE Inference", DATE 2025), as a residency policy.

- §IV-A, memory initialisation: each MoE layer's slots hold the experts the calibration routed to most
  often *in its decode phase* (router_frequency.npz's ``decode_counts``; ``counts`` where a calibration
  lacks them), like ``static`` otherwise.
- §IV-B, sequence-specific expert allocation (Algorithm 1): once per prompt, per layer, the tokens the
  prompt routed to each expert are counted; the most active CPU experts (descending) are paired with the
  least active GPU experts (ascending), at most SwapNum = 0.5 x n_expert pairs, and a pair is swapped
  when the CPU expert's count exceeds SwapInOut = 1.05 times the GPU expert's (line 11). Nothing else
  moves during decoding. The paper writes ">="; we swap on ">" so that two unused experts (0 >= 0) are
  not swapped for nothing; the two differ only at exact equality.

When the swap happens (the paper swaps inside the prefill, layer by layer): a step is one ubatch,
seen as one route per MoE layer in layer order; a step whose first MoE layer routes more than one
token is a *prompt step*. The prompt is the run of prompt steps since the last single-token step
(several ubatches of a long prompt add up); the swap of each layer is decided at the first
single-token step after it (the first decode token), from the prompt's counts of that layer, and its
loads run like any policy's: prefetched and used from the layer's next run, or with ``blocking``
copied before the layer runs. A prompt of one token swaps nothing. In a generation llama.cpp routes
only the last prompt token through the last layer (the only output it needs), so that layer's
counts come from one token; recorded traces ask for every output and see all of them.

Pre-calculation (§IV-C) is measured by edgemoe.analysis.daop_precalc; graceful degradation is the
route policy edgemoe.policies.degrade.GracefulDegradation. PromptSwapResidency gives degradation
DAOP's residency for text evaluated in one ubatch (`edgemoe perplexity`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import EdgeMoeError
from .loads import Load
from .route import RouteRecord

DAOP_SWAP_THRESHOLD = 1.05  # SwapInOut, §IV-B
DAOP_SWAP_SHARE = 0.5  # SwapNum = 0.5 x the layer's experts (Algorithm 1, line 5)


class DaopError(EdgeMoeError, ValueError):
    """A DAOP setting or input is impossible (threshold, frequencies of another model)."""


def check_threshold(threshold: float) -> float:
    if not threshold >= 1.0:
        raise DaopError(
            f"DAOP swap threshold {threshold}: use a ratio >= 1 (the paper's SwapInOut is "
            f"{DAOP_SWAP_THRESHOLD}); below 1 a busier GPU expert could be swapped out"
        )
    return float(threshold)


def initial_placement(frequency: np.ndarray, n_slots: int) -> list[int]:
    """The n_slots experts with the highest frequency (ties: the lower id), in expert order."""
    freq = np.asarray(frequency, dtype=np.float64)
    return sorted(int(e) for e in np.argsort(-freq, kind="stable")[:n_slots])


def swap_pairs(
    counts: np.ndarray,
    resident: Iterable[int],
    *,
    threshold: float = DAOP_SWAP_THRESHOLD,
    max_pairs: int | None = None,
    outside: Iterable[int] | None = None,
) -> list[tuple[int, int]]:
    """Algorithm 1's swaps for one layer: (CPU expert in, GPU expert out) pairs.

    counts (n_expert,): tokens the prompt routed to each expert. The most active CPU experts (ties: the
    lower id) meet the least active GPU experts (ties: the lower id) pair by pair, at most `max_pairs`
    (default SwapNum = n_expert // 2); a pair swaps when counts[in] > threshold * counts[out]. The CPU
    side's counts fall and the GPU side's rise along the pairs, so the first pair that fails ends it.
    `outside`: the experts that may come in (default: every one not resident). DALI's window swap is the
    same rule with threshold 1 and its update as max_pairs (edgemoe.policies.residency.DaliPolicy).
    """
    check_threshold(threshold)
    c = np.asarray(counts)
    res = set(int(e) for e in resident)
    n = int(DAOP_SWAP_SHARE * len(c)) if max_pairs is None else max_pairs
    candidates = (e for e in range(len(c)) if e not in res) if outside is None else outside
    hot = sorted(candidates, key=lambda e: (-c[e], e))
    cold = sorted(res, key=lambda e: (c[e], e))
    pairs = []
    for e_in, e_out in zip(hot[:n], cold[:n], strict=False):
        if not c[e_in] > threshold * c[e_out]:
            break
        pairs.append((e_in, e_out))
    return pairs


@dataclass
class DaopPolicy:
    """Calibration placement, then one swap per prompt (module docstring); no loads during decoding."""

    frequency: Mapping[int, np.ndarray]  # layer -> (n_expert,) decode-phase routing counts of the calibration
    n_slots: Mapping[int, int]  # layer -> slots
    n_expert: int
    threshold: float = DAOP_SWAP_THRESHOLD  # SwapInOut
    blocking: bool = False  # copy a swap before the layer runs (True) or prefetch it for the next step
    n_prompts: int = 0  # prompts whose swaps were decided
    n_swaps: int = 0  # experts swapped in, all layers
    _resident: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> expert -> slot
    _prompt: dict[int, np.ndarray] = field(
        default_factory=dict
    )  # layer -> counts of the prompt, not yet applied
    _last_layer: int | None = None  # the layer of the previous route: a lower or equal one starts a step
    _prompt_step: bool = False  # is the current step a prompt step

    def __post_init__(self) -> None:
        check_threshold(self.threshold)
        for layer, n in self.n_slots.items():
            if n <= 0:
                continue
            freq = np.asarray(self.frequency[layer]) if layer in self.frequency else None
            if freq is None or freq.shape != (self.n_expert,):
                raise DaopError(
                    f"DAOP needs layer {layer}'s routing frequencies over {self.n_expert} experts "
                    f"(got {None if freq is None else freq.shape}): run `edgemoe calibrate MODEL "
                    "--corpus FILE` for this model, or pass its `calibration`"
                )
            self._resident[layer] = {e: s for s, e in enumerate(initial_placement(freq, n))}

    def initial_loads(self) -> list[Load]:
        return [Load(layer, e, s) for layer, res in sorted(self._resident.items()) for e, s in res.items()]

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        ids = np.asarray(ids)
        if self._last_layer is None or layer <= self._last_layer:  # a new step (ubatch)
            was_prompt, self._prompt_step = self._prompt_step, ids.shape[0] > 1
            if self._prompt_step and not was_prompt:
                self._prompt.clear()  # a new prompt: the last one's counts were applied or never will be
            elif was_prompt and not self._prompt_step and self._prompt:
                self.n_prompts += 1
        self._last_layer = layer
        res = self._resident.get(layer)
        if res is None:
            return []
        if self._prompt_step:
            flat = ids.reshape(-1)
            counts = np.bincount(flat[flat >= 0], minlength=self.n_expert)
            self._prompt[layer] = self._prompt.get(layer, 0) + counts
            return []
        counts = self._prompt.pop(layer, None)
        if counts is None:
            return []
        loads = []
        for e_in, e_out in swap_pairs(counts, set(res), threshold=self.threshold):
            slot = res.pop(e_out)
            res[e_in] = slot
            loads.append(Load(layer, e_in, slot))
        self.n_swaps += len(loads)
        return loads

    def resident(self, layer: int) -> set[int]:
        return set(self._resident.get(layer, {}))

    def reseed(self, slots: Mapping[int, Sequence[int]]) -> None:
        """Go on from what is resident (layer -> slot of each expert, -1: absent); a prompt under way is forgotten."""
        self._resident = {
            layer: {e: s for e, s in enumerate(per) if s >= 0}
            for layer, per in slots.items()
            if self.n_slots.get(layer, 0) > 0
        }
        self._prompt.clear()
        self._last_layer = None
        self._prompt_step = False


@dataclass
class PromptSwapResidency:
    """DAOP's residency for text evaluated in one ubatch (a route policy that edits nothing).

    The first `prompt_tokens` rows of every route stand for the prompt: each layer's residency is the
    calibration placement swapped by those rows' counts (Algorithm 1), afresh for every route, so a
    chunk of `edgemoe perplexity` behaves as a prompt prefilled and the rest decoded under the swapped
    placement (routing does not depend on batching). A chunk must fit one ubatch. Put it before
    GracefulDegradation(skip_rows=prompt_tokens) in the chain.
    """

    frequency: Mapping[int, np.ndarray]
    n_slots: Mapping[int, int]
    n_expert: int
    prompt_tokens: int
    threshold: float = DAOP_SWAP_THRESHOLD
    wants_probs: bool = False
    wants_gate_inp: bool = False
    _resident: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_threshold(self.threshold)
        if self.prompt_tokens < 1:
            raise DaopError(
                f"`prompt_tokens={self.prompt_tokens}`: DAOP swaps by a prompt of at least one token"
            )
        self._initial = {
            layer: initial_placement(np.asarray(self.frequency[layer]), n)
            for layer, n in self.n_slots.items()
            if n > 0
        }

    def on_route(self, route: RouteRecord) -> None:
        initial = self._initial.get(route.layer)
        if initial is None:
            return
        flat = np.asarray(route.ids[: self.prompt_tokens]).reshape(-1)
        counts = np.bincount(flat[flat >= 0], minlength=self.n_expert)
        res = set(initial)
        for e_in, e_out in swap_pairs(counts, res, threshold=self.threshold):
            res.discard(e_out)
            res.add(e_in)
        self._resident[route.layer] = res

    def resident(self, layer: int) -> set[int]:
        return set(self._resident.get(layer, self._initial.get(layer, ())))


def replay_all_sizes(
    steps: Sequence[np.ndarray],
    flags: np.ndarray,
    max_slots: int,
    n_expert: int,
    frequency: np.ndarray,
    *,
    threshold: float = DAOP_SWAP_THRESHOLD,
) -> tuple[np.ndarray, np.ndarray]:
    """(misses, loads) of one layer's DaopPolicy (non-blocking) with t = 0..max_slots slots, for
    edgemoe.policies.allocation.replay_curve: every step is one route of this layer, `flags` the
    steps counted. The residency changes only at a swap, so each step costs one product for all t.
    Loads count the initial placement (as `replay_policy` does) and the swaps of counted steps."""
    res = np.zeros((max_slots + 1, n_expert), bool)
    for t in range(1, max_slots + 1):
        res[t, initial_placement(frequency, t)] = True
    misses = np.zeros(max_slots + 1, np.int64)
    loads = np.arange(max_slots + 1, dtype=np.int64)
    prompt: np.ndarray | None = None
    for ids, count in zip(steps, flags, strict=False):
        flat = np.asarray(ids).reshape(-1)
        counts = np.bincount(flat[flat >= 0], minlength=n_expert)
        if count:
            misses += int(counts.sum()) - res.astype(np.int64) @ counts
        if np.asarray(ids).shape[0] > 1:
            prompt = counts if prompt is None else prompt + counts
            continue
        if prompt is None:
            continue
        for t in range(1, max_slots + 1):  # after the step: a non-blocking swap is used from the next one
            pairs = swap_pairs(prompt, set(np.flatnonzero(res[t]).tolist()), threshold=threshold)
            for e_in, e_out in pairs:
                res[t, e_out], res[t, e_in] = False, True
            if count:
                loads[t] += len(pairs)
        prompt = None
    return misses, loads


def precalc_targets(moe_layers: Sequence[int], first_layer: int) -> list[int]:
    """The MoE layers DAOP's pre-calculation from first_layer acts on: those from there on that
    follow a MoE layer."""
    moe = set(moe_layers)
    return [il for il in sorted(moe) if il >= first_layer and il - 1 in moe]
