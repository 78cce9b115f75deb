"""Routing profiles: the routing of real MoE models, bundled as data with the published figures they were
calibrated on, to draw traces of any routing shape for the performance model, `plan` and `trace-synth`.

A profile (edgemoe/analysis/routing_profiles/NAME.json) names the model and its routing shape, the
parameters of the temporal routing model (edgemoe.analysis.routing_temporal) and, per published figure, its
source (link, text, conditions), the value, the tolerance the profile reproduces it within and the
conditions to reproduce it under (`targets`; `evaluate_targets` replays them). `fixture-qwen3moe` is the
tiny trained fixture's routing (its concentration and next-token reuse, edgemoe.analysis.routing_model),
kept as a toy: it is far less local than the real models'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EdgeMoeError
from .routing_model import RoutingStats, synthesize_trace
from .routing_temporal import TemporalParams, draw_ids
from .trace import DECODE, PREFILL, Trace
from .trace_stats import expert_counts, lru_hit_rates, prompt_coverage, reuse_distances, reuse_within

PROFILE_DIR = Path(__file__).with_name("routing_profiles")
ALIASES = {"olmoe": "olmoe-1b-7b", "qwen3-30b": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b"}


@dataclass(frozen=True)
class RoutingProfile:
    name: str
    n_expert: int
    k: int
    n_layer: int
    label: str  # one line: what routing this is
    toy: bool = False  # the fixtures' routing: never chosen for a real model
    params: TemporalParams | None = None  # kind "temporal"
    stats: RoutingStats | None = None  # kind "stats" (the fixture)
    targets: tuple[dict[str, Any], ...] = ()
    doc: dict[str, Any] = field(default_factory=dict, compare=False)  # the whole file (sources, notes)

    def synthesize(
        self,
        *,
        n_expert: int | None = None,
        k: int | None = None,
        n_layer: int | None = None,
        n_seq: int = 4,
        prefill: int = 256,
        decode: int = 256,
        seed: int = 0,
    ) -> Trace:
        """A trace of n_seq prompts (prefill then decode tokens each) with this routing, at the profile's
        shape or another one (expert count, top-k, MoE layers)."""
        e, kk, nl = n_expert or self.n_expert, k or self.k, n_layer or self.n_layer
        if not 1 <= kk <= e:
            raise EdgeMoeError(
                f"top-{kk} of {e} experts is not a routing shape: give a top-k of 1..{e} "
                "(`top_k`) or more experts (`experts`)"
            )
        if n_seq < 1 or prefill + decode < 1:
            raise EdgeMoeError("a synthetic trace needs at least one sequence of at least one token")
        if self.stats is not None:
            tr = synthesize_trace(
                self.stats,
                n_expert=e,
                k=kk,
                n_layer=nl,
                n_seq=n_seq,
                prefill=prefill,
                decode=decode,
                seed=seed,
            )
        else:
            assert self.params is not None
            per = prefill + decode
            ids = draw_ids(self.params, n_expert=e, k=kk, n_layer=nl, seq_lens=[per] * n_seq, seed=seed)
            rng = np.random.default_rng(seed + 1)
            weights = np.sort(rng.dirichlet(np.ones(kk), size=ids.shape[:2]), axis=-1)[..., ::-1]
            phase = np.tile(np.r_[np.full(prefill, PREFILL), np.full(decode, DECODE)], n_seq).astype(np.uint8)
            tr = Trace(
                tokens=np.zeros(len(ids), np.int32),
                layers=np.arange(nl, dtype=np.int32),
                ids=ids,
                weights=np.ascontiguousarray(weights, np.float32),
                phase=phase,
                seq=np.repeat(np.arange(n_seq), per).astype(np.int32),
                meta={
                    "n_expert": e,
                    "n_expert_used": kk,
                    "mode": "decode",
                    "synthetic_routing": True,
                    "note": "routing drawn by edgemoe.analysis.routing_temporal; weights carry no "
                    "information",
                },
            )
        tr.meta.update(routing=self.name, routing_label=self.label, routing_toy=self.toy, seed=seed)
        return tr


def bundled_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def routing_names() -> list[str]:
    """Every name `load_routing_profile` takes: the bundled profiles and their aliases."""
    return bundled_names() + sorted(ALIASES)


@cache
def load_routing_profile(name: str) -> RoutingProfile:
    """A bundled profile by name (or alias: olmoe, qwen3-30b, mixtral)."""
    name = ALIASES.get(name, name)
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise EdgeMoeError(f"no routing profile {name!r}: choose one of {', '.join(bundled_names())}")
    d = json.loads(path.read_text())
    stats = params = None
    if d["kind"] == "stats":
        stats = RoutingStats(mass=np.asarray(d["mass"]), reuse=np.asarray(d["reuse"]), source=d["name"])
    else:
        params = TemporalParams.from_dict(d["params"])
    return RoutingProfile(
        name=d["name"],
        n_expert=int(d["n_expert"]),
        k=int(d["k"]),
        n_layer=int(d["n_layer"]),
        label=d["label"],
        toy=bool(d.get("toy", False)),
        params=params,
        stats=stats,
        targets=tuple(d.get("targets", ())),
        doc=d,
    )


def profile_for_shape(n_expert: int, k: int) -> tuple[RoutingProfile, bool]:
    """The bundled real-model profile with this expert count and top-k, else the nearest (log-distance of both);
    and whether the shape matched exactly. Toy profiles are never chosen."""
    real = [p for p in map(load_routing_profile, bundled_names()) if not p.toy]

    def dist(p: RoutingProfile) -> float:
        return abs(np.log2(p.n_expert / n_expert)) + abs(np.log2(p.k / max(k, 1)))

    best = min(real, key=lambda p: (dist(p), p.name))
    return best, best.n_expert == n_expert and best.k == k


@dataclass(frozen=True)
class ModelRouting:
    """A trace for a model that has no routing data of its own, and where it comes from."""

    trace: Trace
    profile: RoutingProfile
    exact: bool  # the profile's expert count and top-k are the model's (else the nearest bundled one)

    def describe(self) -> str:
        p = self.profile
        how = (
            "its shape" if self.exact else f"the nearest shape to the model's, {p.n_expert} experts top-{p.k}"
        )
        return (
            f"bundled routing profile {p.name} ({how}; {self.trace.n_tokens} tokens drawn at the model's "
            f"{self.trace.n_expert} experts top-{self.trace.ids.shape[2]}, {len(self.trace.layers)} MoE layers)"
        )


def routing_for_model(
    n_expert: int,
    k: int,
    n_layer: int,
    *,
    name: str | None = None,
    n_seq: int = 4,
    prefill: int = 256,
    decode: int = 256,
    seed: int = 0,
) -> ModelRouting:
    """A trace of the model's routing shape from the profile `name`, else from the bundled real-model profile
    that matches the shape (profile_for_shape): what plan and simulate project with when given no trace."""
    if name is not None:
        prof = load_routing_profile(name)
        exact = prof.n_expert == n_expert and prof.k == k
    else:
        prof, exact = profile_for_shape(n_expert, k)
    tr = prof.synthesize(
        n_expert=n_expert, k=k, n_layer=n_layer, n_seq=n_seq, prefill=prefill, decode=decode, seed=seed
    )
    return ModelRouting(tr, prof, exact)


@dataclass(frozen=True)
class TargetCheck:
    metric: str
    published: float
    measured: float
    tolerance: float
    source: str

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.published) <= self.tolerance


def measure(trace: Trace, target: dict[str, Any]) -> float:
    """The target's metric on a trace drawn under its conditions."""
    m, ids, seq = target["metric"], trace.ids, trace.seq
    if m in ("reuse_next", "reuse_within_8"):
        return float(np.mean(reuse_within(reuse_distances(ids, seq), seq, 1 if m == "reuse_next" else 8)))
    if m == "overlap_any":  # P(a token shares at least one expert with the previous one), at one layer
        j = int(target["layer"])
        same = seq[1:] == seq[:-1]
        a, b = ids[:-1, j][same], ids[1:, j][same]
        return float(np.mean([bool(set(x) & set(y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]))
    if m in ("coverage_in_prompt", "coverage_other_prompts"):
        own, other = prompt_coverage(ids, seq, trace.n_expert, float(target.get("share", 0.4)))
        return own if m == "coverage_in_prompt" else float(other if other is not None else np.nan)
    if m == "top_share":  # share of selections taken by the most used `share` of experts, per layer, mean
        c = np.sort(expert_counts(ids, trace.n_expert), axis=1)[:, ::-1]
        top = round(float(target["share"]) * trace.n_expert)
        return float(np.mean(c[:, :top].sum(1) / c.sum(1)))
    if m == "lru_hit_rate":  # each sequence from a cold cache, counted from token `count_from`
        rates = [
            lru_hit_rates(
                ids[seq == s],
                trace.n_expert,
                np.array([int(target["size"])]),
                int(target.get("count_from", 0)),
            ).mean()
            for s in np.unique(seq)
        ]
        return float(np.mean(rates))
    raise EdgeMoeError(f"unknown routing target metric {m!r}")


def evaluate_targets(
    profile: RoutingProfile, *, n_layer: int | None = None, seed: int = 0
) -> list[TargetCheck]:
    """Each published figure of the profile against the same figure on a trace the profile draws under the
    figure's conditions (n_seq prompts of seq_len tokens)."""
    out = []
    for t in profile.targets:
        layers = profile.n_layer if "layer" in t else n_layer or profile.n_layer
        tr = profile.synthesize(
            n_layer=layers, n_seq=int(t.get("n_seq", 1)), prefill=0, decode=int(t["seq_len"]), seed=seed
        )
        out.append(
            TargetCheck(
                metric=t["metric"]
                + (f"@{t['size']}" if "size" in t else "")
                + (f"[layer {t['layer']}]" if "layer" in t else ""),
                published=float(t["value"]),
                measured=measure(tr, t),
                tolerance=float(t["tolerance"]),
                source=str(t["source"]),
            )
        )
    return out
