"""The prefill ubatch a plan opens with: llama.cpp's 512, an `n_ubatch` given, or, for a budget with device
prefill on a machine whose prefill can be priced, the ubatch a prefill model picks for a prompt as long as the
context holds (at most PLANNED_PROMPT tokens). plan() asks the model through PrefillPricing, so the planner never
imports the performance model: edgemoe.perf.model.prefill_plan.ProfilePricing prices it on a machine profile.

Device prefill copies every cached layer's other experts once per ubatch, so a larger ubatch amortizes them;
its larger compute buffer then comes out of the expert slots (edgemoe.plan.reserve.reserve_bytes). A given
`n_ubatch` always wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..gguf.header import GgufHeader
from ..gguf.kv_types import KvTypes

# the prompt length the ubatch is picked for (an agent's first request), at most the context
PLANNED_PROMPT = 8192
DEFAULT_REASON = "llama.cpp's default -ub"
GIVEN_REASON = "given (`n_ubatch`)"


@dataclass(frozen=True)
class PrefillQuestion:
    """What a plan asks the prefill model: the fastest ubatch of edgemoe's device prefill for one prompt."""

    vram: int  # the budget in bytes
    n_ctx: int  # the engine's context
    prompt_tokens: int  # the prompt to prefill (PLANNED_PROMPT, at most the context)
    flash_attn: bool
    kv: KvTypes
    borrow: bool  # the prefill buffers borrow the last cached layers' slots (device_prefill_borrow)


@dataclass(frozen=True)
class UbatchPick:
    """The prefill model's answer."""

    n_ubatch: int
    reason: str  # why, in the model's words (the plan's prefill_ubatch_reason)


class PrefillPricing(Protocol):
    """Something that prices device prefill on a machine and picks its ubatch (the `profile` plan() takes)."""

    @property
    def name(self) -> str:
        """The machine, for messages."""
        ...

    def pick_ubatch(self, header: GgufHeader, question: PrefillQuestion) -> UbatchPick | None:
        """The ubatch the engine should open with, or None where no ubatch of device prefill fits the budget."""
        ...


def planned_prompt(n_ctx: int) -> int:
    """The prompt length a plan's ubatch is picked for at a context of n_ctx."""
    return min(PLANNED_PROMPT, n_ctx)
