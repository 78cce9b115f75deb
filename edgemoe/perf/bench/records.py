"""The records `edgemoe bench` passes along: what a row runs (BenchRow, edgemoe.perf.bench.rows builds it from a
plan), what it measured and what was derived from it (RowResult), and the whole run (BenchResult). Each is frozen:
the runner makes a result, the projector and the stock ratios return new ones."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ...plan.planner import PlacementPlan
from ...plan.reserve import PLAN_UBATCH
from ...runtime.cache_config import CacheConfig
from ...runtime.context_tiers import ContextTiers
from ...speculation.config import SpeculationConfig

WARMUP_PROMPT = 16  # tokens of the prompt each configuration's warm-up generation (2 tokens) starts from
REUSE_QUESTION = 32  # new tokens at the end of the second request on the same prefix (reuse TTFT)


@dataclass(frozen=True)
class Projection:
    """How the simulator projects a row: its configuration's name in a SimSpec like the bench's but for these."""

    config: str  # e.g. "stock-cpu", "stock-n-cpu-moe-30", "edgemoe-lru", "edgemoe-lru-device-prefill"
    n_ubatch: int  # the ubatch the row ran
    n_cpu_moe: int | None = None  # stock's --n-cpu-moe the row ran (None: the bench's)
    policies: tuple[str, ...] | None = None  # the policies to replay (None: the bench's)
    device_prefill_slots: Mapping[int, int] | None = None  # the +device prefill row's own slots
    precalc_from: int | None = None  # pre-calculation from this layer, at the rates the row measures


@dataclass(frozen=True)
class BenchRow:
    """One configuration to measure (llama-bench's cmd_params_instance): its plan (edgemoe.plan.plan(): the load
    config, the slots, the context steps) and what the runner sets on the engine before it runs."""

    name: (
        str  # e.g. "stock -ot exps=CPU", "stock --n-cpu-moe 30", "edgemoe lru", "edgemoe lru +device prefill"
    )
    kind: str  # "stock" | "edgemoe"
    placement: PlacementPlan
    cache: CacheConfig | None = None  # the expert cache it enables (None: stock, or the whole model fits)
    tiers: ContextTiers | None = (
        None  # the plan's context steps as the engine's tiers (None: the whole context)
    )
    speculation: SpeculationConfig | None = None
    note: str = ""
    skip: str | None = None  # why it cannot run (kept as a row that says so)
    projection: Projection | None = None  # None: the performance model does not cover it


@dataclass(frozen=True)
class RowResult:
    """One row's measurement, and what was derived from it (the ratios, the projection)."""

    name: str
    kind: str  # "stock" | "edgemoe"
    prefill_tps: float
    decode_tps: float
    ttft_s: float
    tpot_s: float
    peak_vram_bytes: int | None  # device memory used while it ran (None without a GPU)
    cache: dict[str, Any] | None = None
    note: str = ""
    ratio_decode: float | None = None  # vs the best stock configuration
    ratio_prefill: float | None = None
    projected_decode_tps: float | None = (
        None  # the performance model's projection from this machine's profile
    )
    projected_prefill_tps: float | None = None
    projection_error: float | None = None  # projected / measured decode - 1
    # TTFT of a second request sharing all but the prompt's last REUSE_QUESTION tokens, its KV state restored
    # from host memory as `edgemoe serve`'s prompt cache does
    reuse_ttft_s: float | None = None
    speculation: dict[str, Any] | None = None  # SpeculationStats.to_dict() of the measured generation
    n_ubatch: int = PLAN_UBATCH  # the prefill ubatch it ran (-ub)
    # more measurements by name (a probe's: edgemoe.perf.bench.run.Probe), each a key of the row's JSON
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("metrics"))
        return d


@dataclass(frozen=True)
class BenchResult:
    model: str
    device: str
    vram: int
    threads: int
    prompt_tokens: int
    gen_tokens: int
    slots_per_layer: int  # what the budget gives every MoE layer with equal allocation
    n_cpu_moe: int | None
    rows: tuple[RowResult, ...] = ()
    projection_note: str = ""
    ubatch_note: str = ""  # how the rows' ubatches were picked (empty: llama.cpp's 512 for every row)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d
