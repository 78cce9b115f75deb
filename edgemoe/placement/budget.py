"""The VRAM budget arithmetic of the placement planner: what a budget holds once the dense weights, the KV cache
and llama.cpp's compute buffers are placed (SlotBudget, slot_budget), the reserve that grows with the context,
`--device-prefill`'s two buffers, stock llama.cpp's best --n-cpu-moe, and the context the engine gets.

Pure arithmetic over a model's ModelInfo (edgemoe.gguf.info holds the file's facts); edgemoe.placement.plan,
`edgemoe inspect`, `edgemoe plan`, bench and simulate share it (docs/expert-cache.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..gguf.info import ModelInfo, format_size
from ..gguf.kv_types import F16_KV, KvCacheType, KvTypes, kv_bytes
from ..runtime.config import planned_ctx

CTX_STEP = (
    256  # llama.cpp sizes every context in steps of this many tokens (llama_context: GGML_PAD(n_ctx, 256))
)


def engine_ctx(n_ctx: int, n_ctx_train: int) -> int:
    """The context an Engine of LoadConfig(n_ctx) has on a model trained at n_ctx_train: the engine's default for 0
    (planned_ctx), rounded up to llama.cpp's step. What its KV cache and compute reserve are sized for."""
    return -(-planned_ctx(n_ctx, n_ctx_train) // CTX_STEP) * CTX_STEP


@dataclass(frozen=True)
class SlotBudget:
    """What a VRAM budget holds: the dense part and KV cache first, then expert slots."""

    budget_bytes: int
    n_ctx: int
    dense_bytes: int
    kv_cache_bytes: int  # estimate, see `estimate_kv_cache_bytes`
    reserve_bytes: int  # caller's allowance for compute buffers etc.
    expert_budget_bytes: int  # what is left for experts (0 if the dense part does not fit)
    slot_bytes: int  # one expert slot in every MoE layer together
    experts_per_layer: int  # expert slots per MoE layer (equal per layer)
    n_moe_layers: int
    n_expert: int
    predictor_bytes: int = 0  # expert predictors' weights in the graph (runtime.prediction.device_bytes)
    cache_type_k: KvCacheType = "f16"  # the KV cache's types the estimate is of
    cache_type_v: KvCacheType = "f16"

    @property
    def dense_fits(self) -> bool:
        fixed = self.dense_bytes + self.kv_cache_bytes + self.reserve_bytes + self.predictor_bytes
        return fixed <= self.budget_bytes

    @property
    def expert_fraction(self) -> float:
        """Fraction of all routed experts that fit (1.0 for dense models that fit)."""
        if self.n_expert == 0:
            return 1.0 if self.dense_fits else 0.0
        return self.experts_per_layer / self.n_expert

    @property
    def all_experts_fit(self) -> bool:
        return self.dense_fits and self.experts_per_layer >= self.n_expert


def estimate_kv_cache_bytes(info: ModelInfo, n_ctx: int, kv: KvTypes = F16_KV) -> int:
    """KV cache of `n_ctx` tokens, all layers, with K and V cached as `kv`'s types (llama.cpp's default f16).

    Standard attention: n_layer * n_ctx * (row of n_head_kv * head_k values as type K + the same of head_v as
    type V); f16 is 2 bytes a value, q8_0 34 bytes per 32 (8.5/16 of f16), q4_0 18 per 32 (4.5/16).
    MLA (deepseek2 family, kv_lora_rank > 0): llama.cpp caches only the compressed
    latent plus the rope part as K and no V: n_layer * n_ctx * row of (kv_lora_rank + n_rot) as type K.
    Sliding-window layers (gpt-oss) cache fewer tokens, so this is an upper bound there.
    """
    if info.kv_lora_rank > 0:
        per_token_layer = kv_bytes(kv.k, info.kv_lora_rank + info.n_rot)
    else:
        per_token_layer = kv_bytes(kv.k, info.n_head_kv * info.n_embd_head_k) + kv_bytes(
            kv.v, info.n_head_kv * info.n_embd_head_v
        )
    return (info.n_layer - info.n_nextn) * n_ctx * per_token_layer  # the MTP blocks' own: mtp_reserve_bytes


# what edgemoe leaves free on the GPU for compute buffers and the like when it plans --vram, at contexts up to
# RESERVE_CTX tokens (context_reserve_bytes adds what longer ones need)
VRAM_RESERVE = 512 * 2**20
RESERVE_CTX = 4096
PLAN_UBATCH = 512  # the engine's default n_ubatch


def context_reserve_bytes(info: ModelInfo, n_ctx: int, n_ubatch: int = PLAN_UBATCH) -> int:
    """What llama.cpp's compute buffer grows by past RESERVE_CTX tokens of context: without flash attention it
    holds one ubatch's F32 attention scores, n_ctx x n_ubatch x n_head x 4 bytes. With it (what edgemoe's default
    "auto" resolves to on the CPU) the buffer does not grow: this reserve is then more than needed, kept for a
    backend where "auto" resolves to off. Measured on the CPU backend (the Qwen3-30B-A3B shape, 512-token ubatches): a compute buffer
    of 305 MiB at 4096 tokens, 1086 MiB at 16384, 2142 MiB at 32768; 305 MiB at each with flash attention."""
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
    """What the compute buffer at `n_ubatch` needs beyond the plan's reserve (VRAM_RESERVE, sized for
    PLAN_UBATCH at RESERVE_CTX, and context_reserve_bytes past it): 0 at PLAN_UBATCH, and about n_ubatch times
    the logits' row on a large vocabulary (the output stage is the largest with flash attention)."""
    base = compute_buffer_bytes(info, RESERVE_CTX, PLAN_UBATCH, flash_attn=flash_attn)
    grown = compute_buffer_bytes(info, n_ctx, n_ubatch, flash_attn=flash_attn) - base
    return max(0, grown - context_reserve_bytes(info, n_ctx))


def slot_budget(
    info: ModelInfo,
    budget_bytes: int,
    n_ctx: int = 4096,
    *,
    reserve_bytes: int = 0,
    predictor_bytes: int = 0,
    kv: KvTypes = F16_KV,
) -> SlotBudget:
    """Split a VRAM budget: dense weights + KV cache (+ expert predictors) first, then equal expert slots per
    MoE layer.

    The KV cache is of `n_ctx` tokens cached as `kv`'s types (LoadConfig's cache_type_k / cache_type_v).
    `reserve_bytes` is left free for compute buffers and the like (llama.cpp needs a
    few hundred MiB; the caller knows its batch size, this module does not); a nonzero reserve grows by
    context_reserve_bytes past RESERVE_CTX tokens of context (the plan's reserve_bytes includes it).
    """
    if budget_bytes < 0 or n_ctx <= 0 or reserve_bytes < 0 or predictor_bytes < 0:
        raise ValueError(
            f"budget ({budget_bytes}), n_ctx ({n_ctx}), reserve ({reserve_bytes}) and "
            f"predictors ({predictor_bytes}) must be positive"
        )
    if reserve_bytes:
        reserve_bytes += context_reserve_bytes(info, n_ctx)
    kv_bytes_ = estimate_kv_cache_bytes(info, n_ctx, kv)
    left = max(0, budget_bytes - info.dense_bytes - kv_bytes_ - reserve_bytes - predictor_bytes)
    slot = info.slot_bytes
    slots = min(info.n_expert, left // slot) if slot else 0
    return SlotBudget(
        budget_bytes=budget_bytes,
        n_ctx=n_ctx,
        dense_bytes=info.dense_bytes,
        kv_cache_bytes=kv_bytes_,
        reserve_bytes=reserve_bytes,
        expert_budget_bytes=left,
        slot_bytes=slot,
        experts_per_layer=int(slots),
        n_moe_layers=len(info.moe_layers),
        n_expert=info.n_expert if info.is_moe else 0,
        predictor_bytes=predictor_bytes,
        cache_type_k=kv.k,
        cache_type_v=kv.v,
    )


# bytes a layer's slot tensors may add to its slots' for alignment (up to 11 tensors padded to 256 bytes)
BORROW_SLACK = 4096


def prefill_buffer_bytes(info: ModelInfo) -> int:
    """The two prefill buffers of `--device-prefill`: each holds the largest MoE layer's experts."""
    per_layer = [info.bytes_per_expert_by_layer[il] * info.n_expert for il in info.moe_layers]
    return 2 * max(per_layer, default=0)


def borrow_fits(info: ModelInfo, slots_per_layer: int) -> bool:
    """Device prefill's two buffers fit in the slots of the MoE layers (llama_moe_cache_set_prefill_borrow lends
    whole layers from the last one back; BORROW_SLACK per layer for its slot tensors' padding)."""
    held = sum(slots_per_layer * info.bytes_per_expert_by_layer[il] for il in info.moe_layers)
    return held >= prefill_buffer_bytes(info) + BORROW_SLACK * len(info.moe_layers)


def lent_layers(info: ModelInfo, slots_per_layer: int) -> int:
    """How many MoE layers, from the last one back, lend their whole slot ranges to device prefill's two buffers
    while a prompt is prefilled (0: they do not hold them; borrow_fits)."""
    need, held = prefill_buffer_bytes(info), 0
    for n, il in enumerate(reversed(info.moe_layers), 1):
        held += slots_per_layer * info.bytes_per_expert_by_layer[il] - BORROW_SLACK
        if held >= need:
            return n
    return 0


def mtp_reserve_bytes(
    info: ModelInfo, n_ctx: int, n_ubatch: int, kv: KvTypes = F16_KV, *, flash_attn: bool
) -> int:
    """What drafting with the model's MTP heads (edgemoe.runtime.mtp) takes on the GPU: the MTP blocks' weights
    but their routed experts (those stay in CPU memory), the MTP context's compute buffer (as the model's, at the
    same ubatch) and its KV cache of one layer per block. 0 for a model without MTP heads."""
    if not info.mtp_heads:
        return 0
    n_trunk = max(1, info.n_layer - info.n_nextn)
    kv_bytes = estimate_kv_cache_bytes(info, n_ctx, kv) * info.n_nextn // n_trunk
    return (
        info.mtp_dense_bytes + compute_buffer_bytes(info, n_ctx, n_ubatch, flash_attn=flash_attn) + kv_bytes
    )


def vram_reserve(info: ModelInfo, device_prefill: bool = False) -> int:
    """VRAM kept out of the expert slots: VRAM_RESERVE for llama.cpp's compute buffers, and with `--device-prefill`
    its two prefill buffers."""
    return VRAM_RESERVE + (prefill_buffer_bytes(info) if device_prefill else 0)


def holds_every_expert(info: ModelInfo, budget: SlotBudget, prefill: bool) -> bool:
    """The budget holds the whole model: its dense part, the KV cache and every expert of every MoE layer, with
    llama.cpp's compute reserve (and no --device-prefill buffers: the whole model on the GPU needs none). It then
    runs as stock llama.cpp's -ngl 999 does, without an expert cache, whose slots would hold every expert and
    only add graph nodes (docs/research/performance-model.md: 0.85-1.0x)."""
    fixed = budget.dense_bytes + budget.kv_cache_bytes + budget.reserve_bytes + budget.predictor_bytes
    fixed -= prefill_buffer_bytes(info) if prefill else 0
    return budget.budget_bytes - fixed >= info.n_expert * budget.slot_bytes


def slots_beside_prefill_buffers(
    info: ModelInfo,
    slots_per_layer: Mapping[int, int],
    budget_bytes: int,
    n_ctx: int,
    kv: KvTypes = F16_KV,
) -> dict[int, int]:
    """Slots per MoE layer once `--device-prefill`'s two buffers come out of the budget: the equal count the
    smaller budget leaves, an unequal (dp) allocation scaled by the same ratio."""
    equal = slot_budget(info, budget_bytes, n_ctx=n_ctx, reserve_bytes=VRAM_RESERVE, kv=kv).experts_per_layer
    fewer = slot_budget(
        info, budget_bytes, n_ctx=n_ctx, reserve_bytes=vram_reserve(info, True), kv=kv
    ).experts_per_layer
    return {il: n * fewer // max(1, equal) for il, n in slots_per_layer.items()}


def best_n_cpu_moe(
    info: ModelInfo,
    budget: int,
    n_ctx: int,
    kv: KvTypes = F16_KV,
    *,
    extra_bytes: int = 0,
) -> int | None:
    """The fewest leading MoE layers whose experts must stay on the CPU for the rest to fit (beside a KV cache of
    the given types, and `extra_bytes` more reserve: a larger ubatch's, ubatch_reserve_bytes); None: never fits."""
    fixed = (
        info.dense_bytes
        + estimate_kv_cache_bytes(info, n_ctx, kv)
        + VRAM_RESERVE
        + context_reserve_bytes(info, n_ctx)
        + extra_bytes
    )
    layers = sorted(info.moe_layers)
    per_layer = {il: info.bytes_per_expert_by_layer[il] * info.n_expert for il in layers}
    for n in range(len(layers) + 1):
        if fixed + sum(per_layer[il] for il in layers[n:]) <= budget:
            return n
    return None


def budget_for_slots(
    info: ModelInfo,
    slots: int,
    n_ctx: int,
    kv: KvTypes = F16_KV,
) -> int:
    """The --vram that leaves `slots` expert slots in every MoE layer (beside a KV cache of the given types)."""
    sb = slot_budget(info, 0, n_ctx=n_ctx, reserve_bytes=VRAM_RESERVE, kv=kv)
    return info.dense_bytes + sb.kv_cache_bytes + sb.reserve_bytes + slots * sb.slot_bytes


def _kv_types(plan: SlotBudget) -> str:
    """ ", K q8_0, V q8_0" where the KV cache is not llama.cpp's default f16."""
    if plan.cache_type_k == plan.cache_type_v == "f16":
        return ""
    return f", K {plan.cache_type_k}, V {plan.cache_type_v}"


def format_slot_budget(plan: SlotBudget) -> str:
    reserve = f" + {format_size(plan.reserve_bytes)} compute reserve" if plan.reserve_bytes else ""
    head = (
        f"vram {format_size(plan.budget_bytes)}: dense {format_size(plan.dense_bytes)} + KV cache "
        f"{format_size(plan.kv_cache_bytes)} (ctx {plan.n_ctx}{_kv_types(plan)}){reserve}"
    )
    if not plan.dense_fits:
        return head + " -> does not fit; experts stay on the CPU"
    if plan.n_expert == 0:
        return head + " -> fits"
    return (
        head + f" -> {format_size(plan.expert_budget_bytes)} for experts: {plan.experts_per_layer} of "
        f"{plan.n_expert} experts per layer ({100 * plan.expert_fraction:.0f}%) in "
        f"{plan.n_moe_layers} MoE layers"
    )


def budget_to_dict(plan: SlotBudget) -> dict[str, Any]:
    d = asdict(plan)
    d.update(
        dense_fits=plan.dense_fits, expert_fraction=plan.expert_fraction, all_experts_fit=plan.all_experts_fit
    )
    return d
