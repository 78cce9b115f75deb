"""The routing a projection replays when no trace of the model was recorded: a trace drawn for the model's
expert count and top-k from the bundled routing profile nearest to that shape.

Until the bundled routing profiles of real models land (issue 29, part A), this draws from a stand-in:
edgemoe.analysis.routing_model with the two statistics published for Qwen3-30B-A3B that it can express
(the most used 40% of experts take 92% of a prompt's routed slots; 45% of a token's experts were also the
previous token's, issue 29's table), applied to every shape and labelled `stand-in-qwen3-30b`.
"""
from __future__ import annotations

import numpy as np

from ..analysis.routing_model import QUANTILES, RoutingStats, synthesize_trace
from ..analysis.trace import Trace

STAND_IN = "stand-in-qwen3-30b"
_TOP40_SHARE = 0.92  # Qwen3-30B-A3B: share of one prompt's routed slots the most used 40% of experts take
_REUSE_NEXT = 0.45  # Qwen3-30B-A3B: share of a token's experts the previous token also used


def _stand_in_stats(n_layer: int) -> RoutingStats:
    # mass(q) = 1 - (1 - q)^a through (0.4, 0.92)
    a = np.log(1.0 - _TOP40_SHARE) / np.log(0.6)
    mass = np.tile(1.0 - (1.0 - QUANTILES) ** a, (n_layer, 1))
    return RoutingStats(mass=mass, reuse=np.full(n_layer, _REUSE_NEXT), source=STAND_IN)


def routing_for_shape(n_expert: int, k: int, n_layer: int, *, n_seq: int, prefill: int, decode: int,
                      seed: int = 0) -> tuple[Trace, str]:
    """(a trace of n_seq sequences of prefill then decode tokens, the name of the routing it was drawn from)."""
    trace = synthesize_trace(_stand_in_stats(n_layer), n_expert=n_expert, k=k, n_layer=n_layer, n_seq=n_seq,
                             prefill=prefill, decode=decode, seed=seed)
    return trace, STAND_IN
