"""Adaptive top-k of an Engine (engine.gating): the GatingPolicy set, and its rule handed to llama.cpp's graph.

Where it runs is the routing's choice (edgemoe.runtime.routing): in the graph while nothing needs the routing
callback, else first in the hook chain (same decisions, same kept weights).
"""

from __future__ import annotations

from typing import Any

from ..errors import EdgeMoeError
from ..policies.gating import GatingPolicy, GatingRule
from . import native
from .handle import NativeHandle

# each rule's number in enum ggml_moe_gate_rule, the one C numbering of the op and of llama_moe_set_gating
NATIVE_RULE = {
    GatingRule.SCORE: native.MOE_GATING_SCORE,
    GatingRule.SER: native.MOE_GATING_SER,
    GatingRule.SENSITIVITY: native.MOE_GATING_SENSITIVITY,
}


class Gating:
    """The adaptive top-k policy of one context (None: off) and its setting inside llama.cpp's graph."""

    def __init__(self, handle: NativeHandle, n_layer: int) -> None:
        self.handle = handle
        self.n_layer = n_layer
        self.policy: GatingPolicy | None = (
            None  # adaptive top-k (Engine.set_gating), in the graph or the hook
        )

    def set_policy(self, policy: GatingPolicy | None) -> None:
        """Keep policy (None or the OFF rule: none); the routing then puts it in the graph or the hook."""
        self.policy = policy if policy is not None and policy.rule is not GatingRule.OFF else None

    def set_in_graph(self, policy: GatingPolicy | None) -> None:
        """The gating llama.cpp applies in the graph (None: none; an unchanged setting keeps the graph)."""
        ctx = self.handle.ctx
        if policy is None:
            native.moe_set_gating(ctx, native.MOE_GATING_NONE, 0.0, None, True)
            return
        sens = [policy.layer_sensitivity(il) for il in range(self.n_layer)]
        if (
            native.moe_set_gating(ctx, NATIVE_RULE[policy.rule], policy.threshold, sens, policy.decode_only)
            != 0
        ):
            raise EdgeMoeError(
                f"llama.cpp refused the gating rule {policy.rule.value} with threshold "
                f"{policy.threshold}: {native.recent_log()[-200:].strip()}"
            )

    def reset_counters(self) -> None:
        """Zero the policy's own counters (the hook path's)."""
        if self.policy is not None:
            self.policy.n_routed = self.policy.n_dropped = 0

    def report(self, path: str | None) -> dict[str, Any] | None:
        """{"rule", "threshold", "path", "activation_reduction", "protected", "calibrated"} of the gated routes so
        far, or None; `path`: where it runs (Engine.gating_path)."""
        g = self.policy
        if g is None:
            return None
        if path == "graph":
            st = native.moe_stats(self.handle.ctx)
            reduction = st["n_dropped"] / st["n_routed"] if st["n_routed"] else None
        else:
            reduction = g.activation_reduction
        return {
            "rule": g.rule.value,
            "threshold": g.threshold,
            "path": path,
            "activation_reduction": reduction,
            "protected": g.protected.to_list(),  # experts it never drops (the calibration's super experts)
            "calibrated": dict(g.calibrated) if g.calibrated else None,  # its cost on the validation text
        }
