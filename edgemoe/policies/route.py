"""What a routing policy sees and implements: one MoE layer's routing as numpy arrays.

Pure data and a protocol, with no native code: the runtime (edgemoe.runtime.hooks) builds the
records from llama.cpp's callback, and traces (edgemoe.analysis.trace) replay them offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np


class WeightRule(IntEnum):
    """How a MoE layer turns its selected experts' gating outputs into weights (enum llama_moe_weight_rule)."""

    AS_IS = 0  # the gating outputs themselves (qwen2moe, olmoe, deepseek2, ...)
    NORM = 1  # normalised to sum 1 over the selected (qwen3moe, Mixtral, ...)
    SOFTMAX = 2  # a softmax over the selected logits (gpt-oss)


@dataclass
class RouteRecord:
    """One MoE layer of one ubatch. Arrays are views valid only during the call: copy what you keep."""

    layer: int  # model layer index (il)
    ids: np.ndarray  # (n_tokens, n_expert_used) int32, writable; -1 drops the slot
    weights: np.ndarray  # (n_tokens, n_expert_used) float32, writable: final expert weights
    probs: np.ndarray | None  # (n_tokens, n_expert) float32 gating output, when asked for
    gate_inp: np.ndarray | None  # (n_tokens, n_embd) float32 router input, when asked for
    n_expert: int
    weight_rule: WeightRule = WeightRule.NORM  # the layer's rule; then multiplied by weight_scale
    weight_scale: float = 1.0

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_expert_used(self) -> int:
        return int(self.ids.shape[1])


class RoutePolicy(Protocol):
    """What the hook chain calls. ``wants_probs`` / ``wants_gate_inp`` ask llama.cpp for those arrays."""

    wants_probs: bool
    wants_gate_inp: bool

    def on_route(self, route: RouteRecord) -> None: ...
