"""The prefill ubatch each kind of `edgemoe bench` row runs at (issue 41): a -ub given for every row; else, on a GPU
with a GPU machine profile, the ubatch the prefill plan (edgemoe.perf.model.prefill_plan) picks for the bench's
prompt: stock's fastest -ub (with its --n-cpu-moe beside that compute buffer) for the stock rows, and edgemoe's
planned ubatch (edgemoe.placement.ubatch's rule) for the +device prefill rows, whose slots give up the bytes its
larger compute buffer takes. Elsewhere (the CPU, no profile) every row runs llama.cpp's 512, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..gguf.header import GgufHeader
from ..gguf.kv_types import KvTypes
from ..placement.budget import PLAN_UBATCH, ubatch_reserve_bytes


@dataclass(frozen=True)
class BenchUbatches:
    stock: int = PLAN_UBATCH  # the stock rows' -ub
    stock_n_cpu_moe: int | None = None  # stock's --n-cpu-moe beside that buffer (None: the plan's at 512)
    device_prefill: int = PLAN_UBATCH  # the +device prefill rows' -ub
    cache: int = PLAN_UBATCH  # the other edgemoe rows' -ub
    note: str = ""  # how they were picked (empty: llama.cpp's default)

    def extra_bytes(self, header: GgufHeader, n_ctx: int, n_ubatch: int, flash_attn: bool) -> int:
        """What a row's compute buffer at n_ubatch needs beyond the plan's reserve (out of its slots)."""
        from ..gguf.info import model_info

        return ubatch_reserve_bytes(model_info(header), n_ctx, n_ubatch, flash_attn=flash_attn)


def bench_ubatches(
    header: GgufHeader,
    *,
    vram: int,
    n_ctx: int,
    prompt_tokens: int,
    flash_attn: bool,
    kv: KvTypes,
    given: int | None,
    profile: Path | None,
    on_gpu: bool,
) -> BenchUbatches:
    """The rows' ubatches (see the module's docstring)."""
    if given is not None:
        u = min(given, n_ctx)
        return BenchUbatches(u, None, u, u, f"every row at -ub {u} (given)")
    if not on_gpu or profile is None:
        return BenchUbatches()
    from ..analysis.routing_profile import routing_for_model
    from .model.costmodel import ModelShape
    from .model.prefill_plan import PrefillPlanner, PrefillSpec, settled
    from .model.profile import load_profile

    prof = load_profile(profile)
    if not prof.has_gpu:
        return BenchUbatches()
    shape = ModelShape.from_header(header)
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    spec = PrefillSpec(vram, n_ctx, flash_attn=flash_attn, kv=kv)
    projection = PrefillPlanner(shape, trace, prof, spec).project(min(prompt_tokens, n_ctx))
    # bench's +device prefill row does not borrow
    by_kind = {c.kind: c for c in projection.choices if not c.borrow}
    stock, ours = by_kind.get("stock"), by_kind.get("edgemoe")
    s_ub = stock.best.n_ubatch if stock is not None else PLAN_UBATCH
    s_cpu = stock.best.n_cpu_moe if stock is not None else None
    o_ub = settled(ours).n_ubatch if ours is not None else PLAN_UBATCH
    note = f"-ub planned on {prof.name} for a {min(prompt_tokens, n_ctx)}-token prompt: stock {s_ub}"
    note += f" (--n-cpu-moe {s_cpu}), +device prefill {o_ub}"
    return BenchUbatches(min(s_ub, n_ctx), s_cpu, min(o_ub, n_ctx), PLAN_UBATCH, note)
