"""Each MoE layer's weight rule as llama.cpp applies it (normalised, softmax over the selected, as is;
times a scale), read from the routes of a one-token decode: the patch API reports what the graph
does (llama.cpp's hyper-parameters and per-architecture code), never a guess from numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..policies.route import RouteRecord
from ..runtime.engine import Engine, LoadConfig


@dataclass(frozen=True)
class LayerRule:
    rule: str  # "norm" | "softmax" | "as_is" (WeightRule names, lower case)
    scale: float


class _RuleRecorder:
    wants_probs = False
    wants_gate_inp = False

    def __init__(self) -> None:
        self.rules: dict[int, LayerRule] = {}

    def on_route(self, route: RouteRecord) -> None:
        self.rules[route.layer] = LayerRule(route.weight_rule.name.lower(), float(route.weight_scale))


def routing_rules(path: str | Path, *, threads: int = 0) -> dict[int, LayerRule]:
    """{MoE layer: its weight rule}, from decoding one token of `path` with a recording hook."""
    rec = _RuleRecorder()
    with Engine(path, LoadConfig(n_ctx=256, n_batch=8, n_ubatch=8, n_threads=threads)) as eng:
        eng.set_policies([rec])  # type: ignore[list-item]
        eng.feed([eng.bos_token() if eng.bos_token() >= 0 else 0])
    return rec.rules


def describe_rules(rules: dict[int, LayerRule]) -> str:
    """One line: 'norm, scale 1 (48 layers)' or the distinct rules with their layer counts."""
    if not rules:
        return "no MoE layer routed"
    counts: dict[LayerRule, int] = {}
    for r in rules.values():
        counts[r] = counts.get(r, 0) + 1
    parts = [f"{r.rule}, scale {r.scale:g} ({n} layer{'s' if n > 1 else ''})" for r, n in counts.items()]
    return "; ".join(parts)
