"""What a routing policy sees and implements: one MoE layer's routing as numpy arrays.

Pure data and a protocol, with no native code: the runtime (edgemoe.runtime.hooks) builds the
records from llama.cpp's callback, and traces (edgemoe.analysis.trace) replay them offline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class RouteRecord:
    """One MoE layer of one ubatch. Arrays are views valid only during the call: copy what you keep."""

    layer: int  # model layer index (il)
    ids: np.ndarray  # (n_tokens, n_expert_used) int32, writable; -1 drops the slot
    weights: np.ndarray  # (n_tokens, n_expert_used) float32, writable: final expert weights
    probs: np.ndarray | None  # (n_tokens, n_expert) float32 gating output, when asked for
    gate_inp: np.ndarray | None  # (n_tokens, n_embd) float32 router input, when asked for
    n_expert: int

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
