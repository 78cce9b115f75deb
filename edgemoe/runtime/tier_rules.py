"""Which models context tiers (edgemoe.runtime.context_tiers) may run: pure facts over a GGUF header, so the
planner (edgemoe.plan) asks them without loading the native library."""

from __future__ import annotations

from ..gguf.header import GgufHeader

# architectures whose output a re-created context changes, with why (tests/helpers/arch_sweep_check.py,
# context-tiers)
INEXACT = {
    "deepseek4": "its compressed attention's KV state does not come back exactly through llama.cpp's sequence "
    "state (llama_state_seq_get_data / _set_data), so a context carried to the next step computes other logits",
}
LONGROPE = (
    "its rope factors are LongRoPE's, which llama.cpp picks by the context's size (short up to the original "
    "context, long past it), so a context created at another step computes other logits"
)


def tiers_refusal(header: GgufHeader) -> str | None:
    """Why context tiers would change this model's output (None: they do not): an architecture whose KV state
    does not carry over exactly, or LongRoPE's rope factors (a `rope_factors_long` tensor)."""
    if header.architecture in INEXACT:
        return INEXACT[header.architecture]
    if any(t.name.startswith("rope_factors_long") for t in header.tensors):
        return LONGROPE
    return None
