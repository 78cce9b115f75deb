"""The VRAM budget arithmetic of the planner: what a budget holds once the dense weights, the KV cache and a
reserve (edgemoe.plan.reserve.reserve_bytes: llama.cpp's compute buffers and the like) are placed (SlotBudget,
slot_budget), `--device-prefill`'s two buffers, stock llama.cpp's best --n-cpu-moe, and the context the engine gets.

Pure arithmetic over a model's ModelInfo (edgemoe.gguf.info holds the file's facts); edgemoe.plan.plan(),
`edgemoe inspect`, `edgemoe plan`, bench and simulate share it (docs/expert-cache.md).
"""

from __future__ import annotations

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
    reserve_bytes: int  # compute buffers and the like (edgemoe.plan.reserve.reserve_bytes)
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
    `reserve_bytes` is left free as it is given: compute buffers and the like, edgemoe.plan.reserve.reserve_bytes
    at the same context (the planner's one reserve).
    """
    if budget_bytes < 0 or n_ctx <= 0 or reserve_bytes < 0 or predictor_bytes < 0:
        raise ValueError(
            f"budget ({budget_bytes}), `n_ctx` ({n_ctx}), reserve ({reserve_bytes}) and "
            f"predictors ({predictor_bytes}) must be positive"
        )
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


def holds_every_expert(info: ModelInfo, budget: SlotBudget, prefill: bool) -> bool:
    """The budget holds the whole model: its dense part, the KV cache and every expert of every MoE layer, with
    llama.cpp's compute reserve (and no --device-prefill buffers: the whole model on the GPU needs none). It then
    runs as stock llama.cpp's -ngl 999 does, without an expert cache, whose slots would hold every expert and
    only add graph nodes (docs/research/performance-model.md: 0.85-1.0x)."""
    fixed = budget.dense_bytes + budget.kv_cache_bytes + budget.reserve_bytes + budget.predictor_bytes
    fixed -= prefill_buffer_bytes(info) if prefill else 0
    return budget.budget_bytes - fixed >= info.n_expert * budget.slot_bytes


def best_n_cpu_moe(
    info: ModelInfo, budget: int, n_ctx: int, kv: KvTypes = F16_KV, *, reserve_bytes: int
) -> int | None:
    """The fewest leading MoE layers whose experts must stay on the CPU for the rest to fit beside the dense part, a
    KV cache of the given types and `reserve_bytes` (edgemoe.plan.reserve.reserve_bytes at stock's ubatch); None:
    never fits."""
    fixed = info.dense_bytes + estimate_kv_cache_bytes(info, n_ctx, kv) + reserve_bytes
    layers = sorted(info.moe_layers)
    per_layer = {il: info.bytes_per_expert_by_layer[il] * info.n_expert for il in layers}
    for n in range(len(layers) + 1):
        if fixed + sum(per_layer[il] for il in layers[n:]) <= budget:
            return n
    return None


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
