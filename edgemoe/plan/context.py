"""The trade between context length and expert slots at one VRAM budget: a table of context length x KV cache
type -> expert slots per MoE layer (ContextTable, context_table), and the context the plan picks when none is
asked (default_context).

Every token of context is a KV cache cell (and, without flash attention, compute-buffer rows) taken from the
expert slots; a quantized KV cache gives some of them back. Pure arithmetic over a model's ModelInfo, as
edgemoe.plan.budget is; `edgemoe inspect` prints the table, `edgemoe plan` adds projected speeds
(edgemoe.perf.model.context_speeds), and edgemoe.plan.plan() picks the context from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..gguf.info import ModelInfo, format_size
from ..gguf.kv_types import KvCacheType, KvTypes, block_size, is_quantized
from ..runtime.config import DEFAULT_MAX_CTX, FlashAttn
from .budget import holds_every_expert, slot_budget
from .reserve import PLAN_RESERVE, Reserve, reserve_bytes

# the table's contexts (those up to the model's training context), and its KV types (K and V the same)
TABLE_CTX: tuple[int, ...] = (4096, 16384, 32768, 65536, 131072)
TABLE_KV: tuple[KvCacheType, ...] = ("f16", "q8_0", "q4_0")
# The default context keeps at least this share of the expert slots the budget leaves at 4096 tokens. On the
# Qwen3-30B-A3B routing profile at 8 GiB (rtx4060-laptop, static) the projected decode at 42 of the 52 slots is 3%
# under the 4096-token figure, at 36 6%, at 27 12%, at 15 24%: 75% keeps the loss near 5%, and below it the misses
# grow fast (docs/expert-cache.md, "The context").
KEEP_SLOTS = 0.75


@dataclass(frozen=True)
class ContextRow:
    """What the budget holds at one context with one KV cache type."""

    n_ctx: int  # tokens of context
    kv_type: KvCacheType  # the K and the V cache's type
    slots_per_layer: int  # expert slots per MoE layer the budget leaves (n_expert: the whole model fits)
    whole_model_fits: bool  # every expert fits: it runs as stock -ngl 999, without an expert cache
    dense_fits: bool  # the dense part, the KV cache and the reserve fit the budget at all
    kv_cache_bytes: int
    reserve_bytes: int  # llama.cpp's compute buffers at this context (and --device-prefill's buffers)
    needs_flash_attn: bool  # a quantized V cache runs only with flash attention
    decode_tps: float | None = None  # projected at these slots (None: no machine profile, or no slots)
    prefill_tps: float | None = None


@dataclass(frozen=True)
class ContextTable:
    """Context length x KV type -> expert slots per MoE layer at one budget (rows by context, then type)."""

    budget_bytes: int
    n_ctx_train: int  # the model's training context (0: unknown; the table then goes up to 131072)
    n_expert: int
    flash_attn: FlashAttn  # as asked: "off" refuses the quantized rows
    rows: tuple[ContextRow, ...]
    projected: str = ""  # what the speeds are a projection of ("": none)

    @property
    def slot_counts(self) -> tuple[int, ...]:
        """The distinct slot counts of the rows that have a cache or hold the whole model (what to project)."""
        return tuple(sorted({r.slots_per_layer for r in self.rows if r.dense_fits and r.slots_per_layer > 0}))

    def with_speeds(self, speeds: Mapping[int, tuple[float, float]], projected: str) -> ContextTable:
        """The table with each row's projected (decode, prefill) tok/s, looked up by its slot count."""
        rows = tuple(
            replace(r, decode_tps=s[0], prefill_tps=s[1]) if (s := speeds.get(r.slots_per_layer)) else r
            for r in self.rows
        )
        return replace(self, rows=rows, projected=projected)

    def to_rows(self) -> list[dict[str, Any]]:
        """One JSON object per row (`--json`'s "context_table")."""
        return [asdict(r) for r in self.rows]


def table_contexts(n_ctx_train: int) -> tuple[int, ...]:
    """The table's contexts a model trained at n_ctx_train allows (0: unknown, all of them)."""
    return tuple(c for c in TABLE_CTX if not n_ctx_train or c <= n_ctx_train)


def _takes(info: ModelInfo, kind: KvCacheType) -> bool:
    """The model's head sizes are whole blocks of this type (llama.cpp refuses the type otherwise)."""
    return info.n_embd_head_k % block_size(kind) == 0 and info.n_embd_head_v % block_size(kind) == 0


def _row(info: ModelInfo, budget_bytes: int, n_ctx: int, kv: KvTypes, reserve: Reserve) -> ContextRow:
    what = replace(reserve, kv=kv)
    sb = slot_budget(info, budget_bytes, n_ctx=n_ctx, reserve_bytes=reserve_bytes(info, n_ctx, what), kv=kv)
    whole = sb.dense_fits and holds_every_expert(info, sb, reserve.device_prefill)
    return ContextRow(
        n_ctx=n_ctx,
        kv_type=kv.k,
        slots_per_layer=info.n_expert if whole else sb.experts_per_layer,
        whole_model_fits=whole,
        dense_fits=sb.dense_fits,
        kv_cache_bytes=sb.kv_cache_bytes,
        reserve_bytes=sb.reserve_bytes,
        needs_flash_attn=is_quantized(kv.v),
    )


def context_table(
    info: ModelInfo, budget_bytes: int, *, flash_attn: FlashAttn = "auto", reserve: Reserve | None = None
) -> ContextTable | None:
    """The table of a MoE model at `budget_bytes` (None for a dense model: it has no expert slots). Each row's slots
    are what edgemoe.plan.plan() leaves at that context and type (the same `reserve`: device prefill's buffers and
    the MTP heads included where the plan has them); types whose blocks do not divide the model's head sizes are
    left out."""
    if not info.is_moe:
        return None
    what = reserve if reserve is not None else Reserve(flash_attn=flash_attn != "off")
    rows = tuple(
        _row(info, budget_bytes, c, KvTypes(t, t), what)
        for c in table_contexts(info.n_ctx_train)
        for t in TABLE_KV
        if _takes(info, t)
    )
    return ContextTable(budget_bytes, info.n_ctx_train, info.n_expert, flash_attn, rows)


@dataclass(frozen=True)
class ContextChoice:
    """The context the plan picked for a budget, and why (a note for the user)."""

    n_ctx: int
    note: str


def _slots_at(info: ModelInfo, budget_bytes: int, n_ctx: int, kv: KvTypes, reserve: Reserve) -> int:
    return _row(info, budget_bytes, n_ctx, kv, reserve).slots_per_layer


def default_context(
    info: ModelInfo, budget_bytes: int, kv: KvTypes, *, reserve: Reserve = PLAN_RESERVE
) -> ContextChoice | None:
    """The context for a budget when none is asked: the largest of the table's (up to the training context) whose
    slots per layer at the KV types asked keep >= KEEP_SLOTS of those at 4096 tokens, and never fewer than the
    model's top-k where 4096 has that many. None where the rule has nothing to choose from (a dense model, a
    training context under 4096, a budget the dense part does not fit at 4096): the engine's default then."""
    contexts = table_contexts(info.n_ctx_train)
    if not info.is_moe or not contexts:
        return None
    base = _row(info, budget_bytes, DEFAULT_MAX_CTX, kv, reserve)
    if not base.dense_fits or base.slots_per_layer == 0:
        return None
    need = max(math.ceil(KEEP_SLOTS * base.slots_per_layer), min(info.n_expert_used, base.slots_per_layer))
    slots = {c: _slots_at(info, budget_bytes, c, kv, reserve) for c in contexts}
    chosen = max(c for c in contexts if slots[c] >= need)
    longer = [c for c in contexts if c > chosen]
    trained = (
        f"the model was trained for {info.n_ctx_train}"
        if info.n_ctx_train
        else "its training context is unknown"
    )
    note = (
        f"note: context {chosen} chosen for `vram={format_size(budget_bytes)!r}`: the largest of "
        f"{', '.join(str(c) for c in contexts)} that keeps >= {KEEP_SLOTS:.0%} of the expert slots per layer at "
        f"{DEFAULT_MAX_CTX} ({slots[chosen]} of {base.slots_per_layer})"
        + (f"; {longer[0]} would leave {slots[longer[0]]}" if longer else "")
        + f"; {trained}, pass `n_ctx` to change"
    )
    return ContextChoice(chosen, note)


def _cell(row: ContextRow | None, speeds: bool) -> str:
    if row is None:
        return "-"
    if not row.dense_fits:
        return "no fit"
    text = "all" if row.whole_model_fits else str(row.slots_per_layer)
    if speeds and row.decode_tps is not None and row.prefill_tps is not None:
        text += f" {row.decode_tps:.1f}/{row.prefill_tps:.0f}"
    return text


def format_context_table(table: ContextTable, chosen: int | None = None) -> str:
    """The table as text: one line per context, one column per KV type; `chosen` marks the plan's context."""
    speeds = bool(table.projected)
    kinds: list[KvCacheType] = [k for k in TABLE_KV if any(r.kv_type == k for r in table.rows)]
    by = {(r.n_ctx, r.kv_type): r for r in table.rows}
    what = f"expert slots per MoE layer (of {table.n_expert})"
    what += f" and PROJECTED decode/prefill tok/s ({table.projected})" if speeds else ""
    width = 20 if speeds else 8
    head = f"  {'context':>9}  " + "".join(f"{k + ('*' if is_quantized(k) else ''):>{width}}" for k in kinds)
    lines = [f"context x KV type at {format_size(table.budget_bytes)}: {what}", head]
    for c in dict.fromkeys(r.n_ctx for r in table.rows):
        mark = "<" if c == chosen else " "
        cells = "".join(f"{_cell(by.get((c, k)), speeds):>{width}}" for k in kinds)
        lines.append(f"  {c:>9}{mark} {cells}")
    star = "* a quantized V cache needs flash attention"
    star += ": `flash_attn='off'` refuses these rows" if table.flash_attn == "off" else " (auto turns it on)"
    lines.append(f"  {star}" + ("; <: this plan's context" if chosen is not None else ""))
    return "\n".join(lines)
