"""What a VRAM budget keeps out of the expert slots beside the dense weights and the KV cache: llama.cpp's compute
buffers at the engine's context and ubatch, `--device-prefill`'s two buffers, and the MTP heads' draft context.

reserve_bytes() is the one sum: the plan's split, the context table, the context tiers, stock's best --n-cpu-moe
and the prefill plan all call it, so a term added here reaches every one of them. Pure arithmetic over a model's
ModelInfo (docs/expert-cache.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..gguf.info import ModelInfo
from ..gguf.kv_types import F16_KV, KvTypes
from .budget import estimate_kv_cache_bytes, prefill_buffer_bytes, slot_budget

# what edgemoe leaves free on the GPU for compute buffers and the like when it plans --vram, at contexts up to
# RESERVE_CTX tokens and ubatches up to PLAN_UBATCH (context_reserve_bytes and ubatch_reserve_bytes add the rest)
VRAM_RESERVE = 512 * 2**20
RESERVE_CTX = 4096
PLAN_UBATCH = 512  # the engine's default n_ubatch


class ComputeMeasure(Protocol):
    """llama.cpp's compute buffer on the device measured for one context (edgemoe.perf.measure.compute_buffers: a
    no_alloc load), in bytes; where the plan has one, it replaces compute_buffer_bytes' estimate."""

    def __call__(self, n_ctx: int, n_ubatch: int, flash_attn: bool) -> int: ...


def context_reserve_bytes(info: ModelInfo, n_ctx: int, n_ubatch: int = PLAN_UBATCH) -> int:
    """What llama.cpp's compute buffer grows by past RESERVE_CTX tokens of context: without flash attention it
    holds one ubatch's F32 attention scores, n_ctx x n_ubatch x n_head x 4 bytes. With it (what edgemoe's default
    "auto" resolves to on the CPU) the buffer does not grow: this reserve is then more than needed, kept for a
    backend where "auto" resolves to off. Measured on the CPU backend (the Qwen3-30B-A3B shape, 512-token ubatches): a
    compute buffer of 305 MiB at 4096 tokens, 1086 MiB at 16384, 2142 MiB at 32768; 305 MiB at each with flash
    attention."""
    return max(0, n_ctx - RESERVE_CTX) * n_ubatch * info.n_head * 4


def compute_buffer_bytes(info: ModelInfo, n_ctx: int, n_ubatch: int, *, flash_attn: bool) -> int:
    """llama.cpp's compute buffer for ubatches of `n_ubatch` tokens over a KV cache of `n_ctx` (estimate).

    llama.cpp reserves the buffer for a prompt ubatch whose every token is an output, and its allocator reuses
    memory between the graph's stages, so the buffer is n_ubatch x the largest stage's tensors per token: the
    attention mask (n_ctx values per token, F32, or F16 with flash attention, live until the last layer's
    attention) with the attention stage
    (without flash attention its F32 scores, n_ctx x n_head, beside twice the residual, Q, K and V) or the MoE
    stage (the residual thrice, each used expert's gate, up and product rows and its output); the output stage
    (the F32 logits of every token and two rows of the residual). Fitted on the CPU backend: the fixtures'
    buffers at 512 and 2048 tokens, 4096 and 16384 of context, with and without flash attention (within 2 KiB
    per token), and the Qwen3-30B-A3B shape's (305 MiB at 4096 with 512-token ubatches, 1086 MiB at 16384 and
    2142 MiB at 32768 without flash attention, 305 MiB with it: within 2%). CUDA's memory pool (quantized copies
    of activations, cuBLAS's scratch) is not in it: VRAM_RESERVE's margin covers it at PLAN_UBATCH."""
    f32 = 4
    mask = n_ctx * (2 if flash_attn else f32)
    qkv = (info.n_head + 2 * info.n_head_kv) * max(info.n_embd_head_k, info.n_embd_head_v)
    attention = 2 * (info.n_embd + qkv) * f32 + (0 if flash_attn else n_ctx * info.n_head * f32)
    moe = (3 * info.n_embd + info.n_expert_used * (3 * info.n_ff_exp + info.n_embd)) * f32
    output = (info.n_vocab + 2 * info.n_embd) * f32
    return n_ubatch * max(mask + attention, mask + moe, output)


def ubatch_reserve_bytes(info: ModelInfo, n_ctx: int, n_ubatch: int, *, flash_attn: bool) -> int:
    """What the compute buffer at `n_ubatch` needs beyond VRAM_RESERVE (sized for PLAN_UBATCH at RESERVE_CTX) and
    context_reserve_bytes past it: 0 at PLAN_UBATCH with flash attention, and about n_ubatch times the logits' row
    on a large vocabulary (the output stage is the largest with flash attention)."""
    base = compute_buffer_bytes(info, RESERVE_CTX, PLAN_UBATCH, flash_attn=flash_attn)
    grown = compute_buffer_bytes(info, n_ctx, n_ubatch, flash_attn=flash_attn) - base
    return max(0, grown - context_reserve_bytes(info, n_ctx))


def mtp_reserve_bytes(
    info: ModelInfo,
    n_ctx: int,
    n_ubatch: int,
    kv: KvTypes = F16_KV,
    *,
    flash_attn: bool,
    measured: ComputeMeasure | None = None,
) -> int:
    """What drafting with the model's MTP heads (edgemoe.runtime.mtp) takes on the GPU: the MTP blocks' weights
    but their routed experts (those stay in CPU memory), the MTP context's compute buffer (as the model's, at the
    same ubatch: `measured` where the device's was, else estimated) and its KV cache of one layer per block. 0 for
    a model without MTP heads."""
    if not info.mtp_heads:
        return 0
    n_trunk = max(1, info.n_layer - info.n_nextn)
    kv_bytes = estimate_kv_cache_bytes(info, n_ctx, kv) * info.n_nextn // n_trunk
    compute = (
        measured(n_ctx, n_ubatch, flash_attn)
        if measured is not None
        else compute_buffer_bytes(info, n_ctx, n_ubatch, flash_attn=flash_attn)
    )
    return info.mtp_dense_bytes + compute + kv_bytes


@dataclass(frozen=True)
class Reserve:
    """What the reserve depends on beside the model and the context: the engine's load settings and the request's
    device prefill (the same at every context a plan looks at)."""

    n_ubatch: int = PLAN_UBATCH  # tokens per ubatch (-ub): the compute buffer grows with it
    flash_attn: bool = True  # LoadConfig's flash attention is not "off"
    kv: KvTypes = F16_KV  # the KV cache's types (the MTP heads' cache is of them)
    device_prefill: bool = False  # device prefill's two buffers come out of the budget (not borrowed)
    mtp: bool = False  # the MTP heads are loaded for drafting (LoadConfig.load_mtp)
    # the device's compute buffers measured (None: compute_buffer_bytes' estimate, as where no device is at hand)
    measured: ComputeMeasure | None = None


PLAN_RESERVE = Reserve()  # the engine's defaults: 512-token ubatches, flash attention, an f16 KV cache


def reserve_bytes(info: ModelInfo, n_ctx: int, what: Reserve = PLAN_RESERVE) -> int:
    """Everything a budget keeps out of the expert slots at a context of `n_ctx` beside the dense weights and the
    KV cache: VRAM_RESERVE for llama.cpp's compute buffers, what they grow by past RESERVE_CTX tokens and past
    PLAN_UBATCH tokens a ubatch, device prefill's two buffers where they come out of the budget, and the MTP
    heads' draft context (mtp_reserve_bytes) where they are loaded."""
    fa = what.flash_attn
    if (
        what.measured is not None
    ):  # VRAM_RESERVE covers the buffer at RESERVE_CTX and PLAN_UBATCH; then its growth
        base = what.measured(RESERVE_CTX, PLAN_UBATCH, fa)
        total = VRAM_RESERVE + max(0, what.measured(n_ctx, what.n_ubatch, fa) - base)
    else:
        total = VRAM_RESERVE + context_reserve_bytes(info, n_ctx)
        total += ubatch_reserve_bytes(info, n_ctx, what.n_ubatch, flash_attn=fa)
    total += prefill_buffer_bytes(info) if what.device_prefill else 0
    if what.mtp:
        total += mtp_reserve_bytes(info, n_ctx, what.n_ubatch, what.kv, flash_attn=fa, measured=what.measured)
    return total


def budget_for_slots(info: ModelInfo, slots: int, n_ctx: int, kv: KvTypes = F16_KV) -> int:
    """The --vram that leaves `slots` expert slots in every MoE layer (beside a KV cache of the given types and the
    plan's reserve at that context)."""
    sb = slot_budget(info, 0, n_ctx=n_ctx, reserve_bytes=reserve_bytes(info, n_ctx, Reserve(kv=kv)), kv=kv)
    return info.dense_bytes + sb.kv_cache_bytes + sb.reserve_bytes + slots * sb.slot_bytes


def slots_beside_prefill_buffers(
    info: ModelInfo, slots_per_layer: Mapping[int, int], budget_bytes: int, n_ctx: int, kv: KvTypes = F16_KV
) -> dict[int, int]:
    """Slots per MoE layer once device prefill's two buffers come out of the budget: the equal count the smaller
    budget leaves, an unequal (dp) allocation scaled by the same ratio."""

    def equal(what: Reserve) -> int:
        reserve = reserve_bytes(info, n_ctx, what)
        return slot_budget(info, budget_bytes, n_ctx=n_ctx, reserve_bytes=reserve, kv=kv).experts_per_layer

    plain, fewer = equal(Reserve(kv=kv)), equal(Reserve(kv=kv, device_prefill=True))
    return {il: n * fewer // max(1, plain) for il, n in slots_per_layer.items()}
