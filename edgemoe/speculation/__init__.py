"""Speculative decoding: draft sources propose tokens, one llama_decode verifies them all.

A verification batch of k + 1 positions reads each offloaded expert once for every position routed to it, so it
costs much less than k + 1 decode steps. The pure parts (the config, prompt lookup, the acceptance rules and the
sampling distribution) live here; the sources that run a model (draft.py) and the loop that drives the engine's
sequence (edgemoe.runtime.speculative) are built on them.
"""

from .accept import Verdict, accept_greedy, accept_sampled
from .config import SPECULATE_MODES, SpeculationConfig, SpeculationStats
from .distribution import TokenDistribution
from .lookup import PromptLookup
from .source import DraftSource

__all__ = [
    "SPECULATE_MODES",
    "DraftSource",
    "PromptLookup",
    "SpeculationConfig",
    "SpeculationStats",
    "TokenDistribution",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
]
