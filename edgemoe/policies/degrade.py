"""DAOP's graceful degradation (Zhang et al., DATE 2025, §IV-C): route a token to a GPU-resident expert
instead of a CPU one when their router scores are close, so that the CPU computes fewer experts.

The paper, for Mixtral's top-2: "If two predicted experts are on CPUs, we replace the one with the lower
score with the next-best expert already on the GPU", and keeps the selection when no suitable one is
there. We generalise it with a ratio r: per token, the selected experts that are not resident (except
the one with the highest score, with ``keep_first``) are taken from the lowest score up, and each is
replaced by the best-scoring resident expert the token did not select, while that expert's score is at
least r times the replaced one's (candidates only get worse and the replaced only better along the
way, so the first failure ends it). r = 1 replaces only ties; a smaller r replaces more. The weights
of a changed token are what the layer's weight rule gives the new selection (normalised, as is, or a
softmax over the selected), times its scale. Nothing else changes: a token whose selected experts are
all resident, or that has no close resident alternative, keeps its routing bit for bit. A protected expert (a
model's super experts, edgemoe.policies.protected) is never replaced, nor brought in as a replacement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import EdgeMoeError
from .protected import ProtectedExperts
from .route import RouteRecord, WeightRule


class DegradeError(EdgeMoeError, ValueError):
    """Graceful degradation got an impossible setting or a route without router probabilities."""


class Residency(Protocol):
    """Which experts of a layer are resident (a residency policy, e.g. DaopPolicy)."""

    def resident(self, layer: int) -> set[int]: ...


def check_ratio(ratio: float) -> float:
    if not 0.0 < ratio <= 1.0:
        raise DegradeError(
            f"degradation ratio {ratio}: use 0 < r <= 1 (a resident expert replaces a CPU one "
            "when its router score is at least r times the CPU expert's; e.g. 0.9)"
        )
    return float(ratio)


def router_scores(route: RouteRecord) -> np.ndarray:
    """(n_tokens, n_expert) scores comparable across experts: the gating output (softmax or sigmoid
    probabilities); for a SOFTMAX-weighted layer (gpt-oss), whose gating output is the logits, their softmax."""
    if route.probs is None:
        raise DegradeError(
            "graceful degradation needs the router probabilities: its policy must set wants_probs = True"
        )
    p = np.asarray(route.probs, np.float64)
    if route.weight_rule is WeightRule.SOFTMAX:
        p = np.exp(p - p.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
    return p


def degrade(
    ids: np.ndarray,
    scores: np.ndarray,
    resident: np.ndarray,
    *,
    ratio: float,
    keep_first: bool = True,
    protected: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(new ids, replaced) for ids (T, k) (-1: a dropped slot), scores (T, n_expert), resident (n_expert,) bool.

    replaced (T, k) bool marks the slots that now name a resident expert instead of a non-resident one.
    protected (n_expert,) bool: experts never replaced and never chosen as a replacement.
    """
    check_ratio(ratio)
    out = np.array(ids, copy=True)
    replaced = np.zeros(out.shape, bool)
    fixed = np.zeros(len(resident), bool) if protected is None else protected
    candidates = resident & ~fixed
    if not candidates.any():
        return out, replaced
    for t in range(out.shape[0]):
        row, s = out[t], scores[t]
        valid = [j for j in range(row.shape[0]) if row[j] >= 0]
        if not valid:
            continue
        first = max(valid, key=lambda j: (s[row[j]], -j)) if keep_first else -1
        cpu = sorted(
            (j for j in valid if not resident[row[j]] and not fixed[row[j]] and j != first),
            key=lambda j: (s[row[j]], j),
        )
        if not cpu:
            continue
        chosen = set(int(e) for e in row[valid])
        cands = [int(e) for e in np.argsort(-s, kind="stable") if candidates[e] and int(e) not in chosen]
        for j, e_new in zip(cpu, cands, strict=False):
            if not s[e_new] >= ratio * s[row[j]]:
                break
            row[j] = e_new
            replaced[t, j] = True
    return out, replaced


def rule_weights(scores_sel: np.ndarray, keep: np.ndarray, rule: WeightRule, scale: float) -> np.ndarray:
    """(T, k) float32 weights the layer's rule gives the selected gating outputs `scores_sel` (T, k);
    slots not kept get 0."""
    g = np.where(keep, np.asarray(scores_sel, np.float64), 0.0)
    if rule is WeightRule.NORM:
        g = g / np.maximum(g.sum(1, keepdims=True), 6.103515625e-5)  # llama.cpp clamps the sum the same way
    elif rule is WeightRule.SOFTMAX:
        z = np.where(keep, g, -np.inf)
        z = np.exp(z - z.max(1, keepdims=True))
        g = z / z.sum(1, keepdims=True)
    return (g * scale).astype(np.float32)


@dataclass
class GracefulDegradation:
    """A route policy: degrade() each token against `residency`, counting what it saves.

    decode_only leaves multi-token ubatches (prompts) alone, as DAOP degrades during decoding;
    skip_rows leaves the first rows of every route alone (with PromptSwapResidency in `edgemoe
    perplexity`, the prompt part of a chunk).
    """

    residency: Residency
    ratio: float = 0.9
    keep_first: bool = (
        True  # never replace the token's highest-scored expert (the paper replaces the lower one)
    )
    decode_only: bool = True
    skip_rows: int = 0
    protected: ProtectedExperts = field(default_factory=ProtectedExperts)  # never replaced nor brought in
    wants_probs: bool = True
    wants_gate_inp: bool = False
    n_routed: int = 0  # selected expert slots of the rows it handled
    n_cpu: int = 0  # of these, slots whose expert was not resident (CPU executions without degradation)
    n_replaced: int = 0  # of these, slots moved to a resident expert (CPU executions avoided)

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    def on_route(self, route: RouteRecord) -> None:
        if self.decode_only and route.n_tokens > 1:
            return
        rows = slice(self.skip_rows, None)
        ids = route.ids[rows]
        if ids.shape[0] == 0:
            return
        resident = np.zeros(route.n_expert, bool)
        resident[list(self.residency.resident(route.layer))] = True
        valid = ids >= 0
        self.n_routed += int(valid.sum())
        self.n_cpu += int((valid & ~resident[np.where(valid, ids, 0)]).sum())
        if not resident.any():
            return
        scores = router_scores(route)[rows]
        fixed = np.zeros(route.n_expert, bool)
        fixed[self.protected.experts(route.layer)] = True
        new, replaced = degrade(
            ids, scores, resident, ratio=self.ratio, keep_first=self.keep_first, protected=fixed
        )
        if not replaced.any():
            return
        self.n_replaced += int(replaced.sum())
        changed = replaced.any(1)
        new_c = new[changed]
        keep = new_c >= 0
        p = np.asarray(route.probs, np.float64)[rows][changed]
        sel = np.take_along_axis(p, np.where(keep, new_c, 0), axis=1)
        ids[changed] = new_c
        route.weights[rows][changed] = rule_weights(sel, keep, route.weight_rule, route.weight_scale)

    def report(self) -> dict[str, float | int | None]:
        """Its ratio and counters, as `generate --json` and `perplexity --json` print them."""
        return {
            "ratio": self.ratio,
            "routed": self.n_routed,
            "cpu": self.n_cpu,
            "replaced": self.n_replaced,
            "cpu_avoided": self.cpu_avoided,
        }

    @property
    def cpu_avoided(self) -> float | None:
        """Share of the CPU expert executions it avoided (None before any)."""
        return self.n_replaced / self.n_cpu if self.n_cpu else None
