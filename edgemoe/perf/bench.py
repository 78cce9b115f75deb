"""`edgemoe bench`: stock llama.cpp placements vs edgemoe's expert cache, one process, one run.

Stock configurations run through the same library with no hook and no cache, which builds
llama.cpp's own graph: all routed experts in CPU memory (``-ot exps=CPU``) and the best
``--n-cpu-moe N`` that fits the VRAM budget (the first N layers' experts on the CPU, the rest on
the GPU). edgemoe runs its policies with the slots the same budget leaves (split per layer by DP
allocation when the calibration has a routing trace, or equally: BenchSpec.alloc). Every configuration
gets the same prompt (fixed random token ids), the same threads and the same greedy decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..calibration.slot_alloc import allocate_slots
from ..errors import EdgeMoeError
from ..gguf.header import check_gguf
from ..gguf.info import ModelInfo, model_info
from ..gguf.kv_types import KvCacheType, KvTypes
from ..placement.budget import PLAN_UBATCH, best_n_cpu_moe, slots_beside_prefill_buffers
from ..placement.planner import Device, budget_request, load_reserve_bytes
from ..placement.planner import plan as plan_placement
from ..placement.tiers import context_steps, engine_tiers
from ..policies.registry import policy_spec
from ..runtime import native
from ..runtime.cache_config import CacheConfig, calibrated_config
from ..runtime.config import FlashAttn
from ..runtime.engine import Engine, LoadConfig
from ..runtime.sampling import GREEDY
from ..speculation.config import SpeculationConfig
from .bench_ubatch import BenchUbatches, bench_ubatches
from .kld_column import kld_cells

WARMUP_PROMPT = 16  # tokens of the prompt each configuration's warm-up generation (2 tokens) starts from
REUSE_QUESTION = 32  # new tokens at the end of the second request on the same prefix (reuse TTFT)


@dataclass(frozen=True)
class BenchSpec:
    vram: int  # budget in bytes
    prompt_tokens: int = 512
    gen_tokens: int = 64
    threads: int = 0
    n_ctx: int = 0  # 0: prompt + gen rounded up
    # also run each policy's first row with the context created in steps ("... +tiers"; where n_ctx has a step)
    context_tiers: bool = False
    policies: tuple[str, ...] = ("lru", "static")
    calibration: Path | None = None
    profile: Path | None = None  # this machine's profile for the projections (None: none are made)
    alloc: str | None = None  # "equal", "dp"; None: dp when the calibration has a routing trace
    compare_overlap: bool = False  # also run each policy with CPU/GPU overlap off ("... no-overlap" rows)
    # also run lru and dali with this CPU/GPU assigner ("... +assign ratio" rows), priced by `profile`
    assign: str | None = None
    # also run each policy with prefill ubatches of this many tokens on the device ("... +device prefill" rows,
    # the two prefill buffers come out of the slots' budget); 0: not
    device_prefill: int = 0
    device_prefill_borrow: bool = False  # also a '+device prefill borrow' row: its buffers in borrowed slots
    # also run each policy with DAOP's pre-calculation from this layer ("... +precalc L" rows); None: not
    precalc_from: int | None = None
    flash_attn: FlashAttn = "auto"  # every row's (LoadConfig's)
    cache_type_k: KvCacheType = "f16"  # every row's KV cache types; the plan reserves that cache
    cache_type_v: KvCacheType = "f16"
    # also run the best stock row and each policy's first row with this speculative decoding ("... +lookup" rows)
    speculation: SpeculationConfig | None = None
    # every row's prefill ubatch (-ub); None: on a GPU with a GPU profile the prefill plan's for stock and +device
    # prefill rows (edgemoe.perf.bench_ubatch), else 512
    n_ubatch: int | None = None
    kld_base: Path | None = (
        None  # --kld: each output-changing row's KL divergence against it (perf.kld_column)
    )


@dataclass
class BenchRow:
    name: str  # e.g. "stock -ot exps=CPU", "stock --n-cpu-moe 30", "edgemoe lru"
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
    kld: dict[str, Any] | None = None  # against BenchSpec.kld_base, where the row changes the output


@dataclass
class BenchResult:
    model: str
    device: str
    vram: int
    threads: int
    prompt_tokens: int
    gen_tokens: int
    slots_per_layer: int  # what the budget gives every MoE layer with equal allocation
    n_cpu_moe: int | None
    rows: list[BenchRow] = field(default_factory=list)
    projection_note: str = ""
    ubatch_note: str = ""  # how the rows' ubatches were picked (empty: llama.cpp's 512 for every row)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        return d


def _prompt(info: ModelInfo, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(16, max(17, min(info.n_vocab, 32000)), n)]


def _reuse_ttft(eng: Engine, prompt: list[int]) -> float:
    """Seconds to the first token of a request on the same prefix with a new question, after another
    conversation emptied the KV cache: restore the stored state, evaluate the question, sample."""
    snap = eng.snapshot()
    eng.reset()
    rng = np.random.default_rng(1)
    question = [int(t) for t in rng.integers(16, max(prompt) + 1, min(REUSE_QUESTION, len(prompt) - 1))]
    t0 = time.perf_counter()
    eng.restore(snap)
    second = prompt[: len(prompt) - len(question)] + question
    eng.generate(second, max_tokens=1, sampling=GREEDY, ignore_eog=True)
    return time.perf_counter() - t0


def _measure(
    path: Path, config: LoadConfig, prompt: list[int], gen: int, setup: Callable[[Engine], None] | None = None
) -> tuple[float, float, float, float, int | None, Any, list[int], float, dict[str, Any] | None]:
    dev = native.gpu_device()
    free0 = native.device_memory(dev)[0] if dev is not None else None
    with Engine(path, config) as eng:
        if setup is not None:
            setup(eng)
        eng.generate(prompt[:WARMUP_PROMPT], max_tokens=2, sampling=GREEDY, ignore_eog=True)  # warm-up
        eng.reset()
        if eng.experts is not None:
            eng.experts.reset_stats()
        t0 = time.perf_counter()
        g = eng.generate(prompt, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
        wall = time.perf_counter() - t0
        used = free0 - native.device_memory(dev)[0] if dev is not None and free0 is not None else None
        cache = (
            {
                **eng.experts.stats(),
                "prefill": eng.experts.prefill_stats(),
                "precalc": eng.experts.precalc_stats(),
            }
            if eng.experts is not None
            else None
        )
        reuse = _reuse_ttft(eng, prompt)
    t = g.timings
    tpot = 1.0 / t.decode_tps if t.decode_tps > 0 else wall
    spec = g.speculation.to_dict() if g.speculation is not None else None
    return t.prompt_tps, t.decode_tps, t.ttft_s, tpot, used, cache, g.tokens, reuse, spec


# a bench row: (name, kind, load config, what to do to the engine before it runs, note)
_Row = tuple[str, str, LoadConfig, Callable[[Engine], None] | None, str]


@dataclass(frozen=True)
class _CacheRows:
    """What every edgemoe row of a bench shares."""

    info: ModelInfo
    spec: BenchSpec
    dev: Any  # the GPU device (None: the CPU stand-in)
    n_ctx: int
    slots: int  # equal slots per MoE layer
    expert_budget_bytes: int
    cached: LoadConfig  # the load config of a row with the expert cache
    costs: dict[int, Any] | None  # the assigner's costs (--assign)
    header: Any = None  # the model's parsed header (the ubatches' compute buffers)
    ubatches: BenchUbatches = BenchUbatches()

    def enable(self, cfg: CacheConfig) -> Callable[[Engine], None]:
        """The row's setup: the expert cache with `cfg` on the bench's device."""

        def setup(eng: Engine) -> None:
            eng.enable_expert_cache(cfg, device=self.dev)

        return setup


def _policy_rows(b: _CacheRows, pol: str) -> list[_Row]:
    """The rows of one policy: with and without the overlap (--compare-overlap), then +assign, +device
    prefill and +precalc where the spec asks for them; one failing row where its allocation fails."""
    spec = b.spec
    try:
        allocation = allocate_slots(
            b.info,
            alloc=spec.alloc,
            policy=pol,
            calibration=spec.calibration,
            slots_per_layer=b.slots,
            budget_bytes=b.expert_budget_bytes,
        )
    except EdgeMoeError as err:  # reported as the policy's row, skipped

        def fail(eng: Engine, err: EdgeMoeError = err) -> None:
            raise err

        return [(f"edgemoe {pol}", "edgemoe", b.cached, fail, "")]
    cfg = CacheConfig(
        b.slots if allocation.alloc == "equal" else allocation.slots,
        policy=calibrated_config(pol, spec.calibration),
        alloc=allocation.alloc,
    )
    notes = ([] if b.dev is not None else ["cache on the CPU stand-in"]) + (
        [allocation.note] if allocation.note else []
    )
    name = f"edgemoe {pol}" + (" dp" if allocation.alloc == "dp" else "")
    rows: list[_Row] = [
        (
            name + ("" if overlap else " no-overlap"),
            "edgemoe",
            b.cached,
            b.enable(replace(cfg, overlap=overlap)),
            "; ".join(notes),
        )
        for overlap in ((True, False) if spec.compare_overlap else (True,))
    ]
    if b.costs is not None and policy_spec(pol).assignable:
        assigned = calibrated_config(pol, spec.calibration, assign=spec.assign, assign_costs=b.costs)
        rows.append(
            (
                f"{name} +assign {spec.assign}",
                "edgemoe",
                b.cached,
                b.enable(replace(cfg, policy=assigned)),
                "; ".join(notes + ["in the routing hook"]),
            )
        )
    if spec.device_prefill:
        rows.append(
            _device_prefill_row(
                b, allocation.slots if allocation.alloc != "equal" else None, cfg, name, notes
            )
        )
    if spec.device_prefill and spec.device_prefill_borrow:
        borrowed = replace(cfg, prefill_min_tokens=spec.device_prefill, prefill_borrow=True)
        note = "; ".join(notes + ["every slot kept: the prefill buffers borrow the last layers' slots"])
        rows.append((f"{name} +device prefill borrow", "edgemoe", b.cached, b.enable(borrowed), note))
    if spec.context_tiers:
        rows += _tiers_rows(b, cfg, pol, name, notes)
    if spec.precalc_from is not None:
        rows.append(
            (
                f"{name} +precalc {spec.precalc_from}",
                "edgemoe",
                b.cached,
                b.enable(replace(cfg, precalc_from=spec.precalc_from)),
                "; ".join(notes),
            )
        )
    return rows


def _tiers_rows(b: _CacheRows, cfg: CacheConfig, pol: str, name: str, notes: list[str]) -> list[_Row]:
    """The +tiers row (none where the bench's context has no step below it): the cache as the policy's row, then
    the context re-created at the smallest step that holds the tokens, each step's slots allocated as the row's
    (equal, or dp over the step's bytes), as `generate --vram` does."""
    spec = b.spec
    kv = KvTypes(spec.cache_type_k, spec.cache_type_v)
    steps = context_steps(b.info, spec.vram, b.n_ctx, kv, n_batch=b.cached.n_batch)
    if not steps:
        return []

    def setup(eng: Engine) -> None:
        eng.enable_expert_cache(cfg, device=b.dev)
        tiers = engine_tiers(
            b.info, steps, eng.n_ctx, cfg, alloc=spec.alloc, policy=pol, calibration=spec.calibration
        )
        eng.set_context_tiers(tiers)

    steps_note = "steps " + "/".join(f"{s.n_ctx}:{s.slots_per_layer}" for s in steps)
    return [(f"{name} +tiers", "edgemoe", b.cached, setup, "; ".join([*notes, steps_note]))]


def _speculating(row: _Row, speculation: SpeculationConfig) -> _Row:
    """`row` again with speculative decoding ("... +lookup"); `mtp` loads the model's MTP heads for it."""
    name, kind, cfg, setup_fn, note = row
    if speculation.mode == "mtp":
        cfg = replace(cfg, load_mtp=True)

    def setup(eng: Engine) -> None:
        if setup_fn is not None:
            setup_fn(eng)
        eng.set_speculation(speculation)

    return (f"{name} +{speculation.mode}", kind, cfg, setup, note)


def _device_prefill_row(
    b: _CacheRows, dp_slots: dict[int, int] | None, cfg: CacheConfig, name: str, notes: list[str]
) -> _Row:
    """The +device prefill row: the slots (equal, or the DP allocation's `dp_slots`) beside the two buffers."""
    spec = b.spec
    pf_slots = slots_beside_prefill_buffers(
        b.info,
        {il: b.slots for il in b.info.moe_layers} if dp_slots is None else dp_slots,
        spec.vram,
        b.n_ctx,
        KvTypes(spec.cache_type_k, spec.cache_type_v),
    )
    u = b.ubatches.device_prefill
    load = b.cached
    if u != load.n_ubatch:  # the larger compute buffer comes out of every layer's slots
        extra = b.ubatches.extra_bytes(b.header, b.n_ctx, u, spec.flash_attn != "off")
        fewer = -(-extra // b.info.slot_bytes) if b.info.slot_bytes else 0
        pf_slots = {il: max(0, n - fewer) for il, n in pf_slots.items()}
        load = replace(load, n_batch=max(load.n_batch, u), n_ubatch=u)
    pf_cfg = replace(cfg, slots_per_layer=pf_slots, prefill_min_tokens=spec.device_prefill)
    per_layer = sum(pf_slots.values()) // max(1, len(pf_slots))
    note = "; ".join(notes + [f"{per_layer} slots/layer beside the prefill buffers"])
    return (f"{name} +device prefill", "edgemoe", load, b.enable(pf_cfg), note)


def _run_rows(
    res: BenchResult,
    rows: list[_Row],
    path: Path,
    prompt: list[int],
    gen: int,
    progress: Callable[[str], None] | None,
) -> list[int]:
    """Measure each row into `res.rows` (a row that fails is kept with its error); returns the tokens the
    first row that ran generated."""
    generated: list[int] = []
    for name, kind, cfg, setup_fn, note in rows:
        if progress:
            progress(name)
        try:
            pre, dec, ttft, tpot, vram, cache, tokens, reuse, spec = _measure(
                path, cfg, prompt, gen, setup_fn
            )
        except Exception as err:  # noqa: BLE001 - one configuration failing (no calibration...) is a row
            res.rows.append(BenchRow(name, kind, 0.0, 0.0, 0.0, 0.0, None, note=f"skipped: {err}"))
            continue
        generated = generated or tokens
        ub = min(cfg.n_ubatch, cfg.n_batch, cfg.n_ctx or cfg.n_ubatch)
        res.rows.append(
            BenchRow(
                name,
                kind,
                pre,
                dec,
                ttft,
                tpot,
                vram,
                cache,
                note,
                reuse_ttft_s=reuse,
                speculation=spec,
                n_ubatch=ub,
            )
        )
    return generated


def _stock_ratios(res: BenchResult) -> None:
    """Each measured row's speeds over the fastest stock row's."""
    stock = [r for r in res.rows if r.kind == "stock" and r.decode_tps > 0]
    if stock:
        best_dec = max(r.decode_tps for r in stock)
        best_pre = max(r.prefill_tps for r in stock)
        for r in res.rows:
            if r.decode_tps > 0:
                r.ratio_decode = r.decode_tps / best_dec
                r.ratio_prefill = r.prefill_tps / best_pre


def run_bench(path: Path, spec: BenchSpec, progress: Callable[[str], None] | None = None) -> BenchResult:
    header = check_gguf(path)
    info = model_info(header)
    n_ctx = spec.n_ctx or int(np.ceil((spec.prompt_tokens + spec.gen_tokens + 16) / 256) * 256)
    dev = native.gpu_device()
    on_gpu = dev is not None
    placement = plan_placement(
        header,
        budget_request(spec.vram),
        n_ctx=n_ctx,
        device=Device(native.device_name(dev)) if dev is not None else None,
        flash_attn=spec.flash_attn,
        cache_type_k=spec.cache_type_k,
        cache_type_v=spec.cache_type_v,
    )
    ubs = bench_ubatches(
        header,
        vram=spec.vram,
        n_ctx=n_ctx,
        prompt_tokens=spec.prompt_tokens,
        flash_attn=spec.flash_attn != "off",
        kv=KvTypes(spec.cache_type_k, spec.cache_type_v),
        given=spec.n_ubatch,
        profile=spec.profile,
        on_gpu=on_gpu,
    )
    base = LoadConfig(
        n_ctx=n_ctx,
        n_batch=max(PLAN_UBATCH, ubs.cache),
        n_ubatch=ubs.cache,
        n_threads=spec.threads,
        n_gpu_layers=999 if on_gpu else 0,
        flash_attn=spec.flash_attn,
        cache_type_k=spec.cache_type_k,
        cache_type_v=spec.cache_type_v,
    )
    moe = tuple(info.moe_layers)
    cpu_moe = moe if on_gpu else None  # without a GPU everything is in CPU memory (and stock keeps repacking)
    assert placement.budget is not None  # a request with a budget has its split
    slots = placement.budget.experts_per_layer
    n_cpu = placement.n_cpu_moe
    res = BenchResult(
        model=path.name,
        device=native.device_name(dev) if on_gpu else "CPU (no GPU in this build)",
        vram=spec.vram,
        threads=spec.threads,
        prompt_tokens=spec.prompt_tokens,
        gen_tokens=spec.gen_tokens,
        slots_per_layer=slots,
        n_cpu_moe=n_cpu,
        ubatch_note=ubs.note,
    )
    prompt = _prompt(info, spec.prompt_tokens)
    rows = _stock_rows(base, moe, cpu_moe, n_cpu if on_gpu else None, ubs)
    cached = replace(base, cpu_expert_layers=cpu_moe)
    costs = _assign_costs(path, spec) if spec.assign else None
    b = _CacheRows(
        info, spec, dev, n_ctx, slots, placement.budget.expert_budget_bytes, cached, costs, header, ubs
    )
    again = rows[
        -1:
    ]  # with speculation: the best stock layout's row (the last stock one), each policy's first
    for pol in spec.policies:
        policy_rows = _policy_rows(b, pol)
        again.append(policy_rows[0])
        rows += policy_rows
    if spec.speculation is not None and spec.speculation.on:
        # the MTP heads' reserve comes out of the slots and stock's GPU layers
        if spec.speculation.mode == "mtp":
            again = _beside_mtp_heads(b, base, moe, cpu_moe, n_cpu if on_gpu else None)
        rows += [_speculating(r, spec.speculation) for r in again]
    generated = _run_rows(res, rows, path, prompt, spec.gen_tokens, progress)
    if spec.kld_base is not None:
        from .kld_column import add_kld_column

        add_kld_column(res.rows, rows, path, spec.kld_base, progress)
    if spec.profile is not None and generated:
        if progress:
            progress("projection (trace + performance model)")
        project(res, path, spec, base, prompt + generated[:-1], len(prompt), on_gpu)
    _stock_ratios(res)
    return res


def _stock_rows(
    base: LoadConfig,
    moe: tuple[int, ...],
    cpu_moe: tuple[int, ...] | None,
    n_cpu: int | None,
    ubs: BenchUbatches,
) -> list[_Row]:
    """Stock's rows at stock's -ub: every expert on the CPU (-ot exps=CPU), and on a GPU the best --n-cpu-moe
    (`n_cpu`, or the one beside the planned ubatch's compute buffer) where it keeps some experts there."""
    stock = replace(base, n_batch=max(base.n_batch, ubs.stock), n_ubatch=ubs.stock)
    rows: list[_Row] = [("stock -ot exps=CPU", "stock", replace(stock, cpu_expert_layers=cpu_moe), None, "")]
    if n_cpu is not None and ubs.stock_n_cpu_moe is not None:
        n_cpu = ubs.stock_n_cpu_moe
    if n_cpu is not None and n_cpu < len(moe):
        layers = moe[:n_cpu] or None
        rows.append(
            (f"stock --n-cpu-moe {n_cpu}", "stock", replace(stock, cpu_expert_layers=layers), None, "")
        )
    return rows


def _beside_mtp_heads(
    b: _CacheRows, base: LoadConfig, moe: tuple[int, ...], cpu_moe: tuple[int, ...] | None, n_cpu: int | None
) -> list[_Row]:
    """The rows `--speculate mtp` runs again, planned beside the MTP heads (placement.budget.mtp_reserve_bytes):
    the best stock layout with the --n-cpu-moe that leaves room for them, each policy's first row with the slots
    their bytes leave (the heads' routed experts stay in CPU memory)."""
    spec, info, ubs = b.spec, b.info, b.ubatches
    with_heads = replace(b.cached, load_mtp=True)
    mtp = load_reserve_bytes(info, with_heads, b.n_ctx, b.cached.n_ubatch)
    if n_cpu is not None:
        fa = with_heads.flash_attn != "off"
        # the MTP context's compute buffer is the model's at the row's own ubatch
        extra = ubs.extra_bytes(b.header, b.n_ctx, ubs.stock, fa) + load_reserve_bytes(
            info, with_heads, b.n_ctx, ubs.stock
        )
        kv = KvTypes(with_heads.cache_type_k, with_heads.cache_type_v)
        n_cpu = best_n_cpu_moe(info, spec.vram, b.n_ctx, kv, extra_bytes=extra)
        n_cpu = len(moe) if n_cpu is None else n_cpu
    stock = _stock_rows(base, moe, cpu_moe, n_cpu, replace(ubs, stock_n_cpu_moe=n_cpu))[-1:]
    fewer = -(-mtp // info.slot_bytes) if info.slot_bytes else 0
    heads = replace(b, slots=max(0, b.slots - fewer), expert_budget_bytes=max(0, b.expert_budget_bytes - mtp))
    note = f"{heads.slots} slots/layer beside the MTP heads ({mtp / 2**20:.0f} MiB)"
    return stock + [_noted(_policy_rows(heads, pol)[0], note) for pol in spec.policies]


def _noted(row: _Row, note: str) -> _Row:
    name, kind, cfg, setup, before = row
    return (name, kind, cfg, setup, "; ".join(x for x in (before, note) if x))


def _assign_costs(path: Path, spec: BenchSpec) -> dict[int, Any]:
    """The assigner's per-layer costs from the bench's profile (it must have a GPU)."""
    from .model.costmodel import ModelShape, expert_costs
    from .model.profile import load_profile

    if spec.profile is None:
        raise EdgeMoeError(
            "bench `assign` prices the assignment with `profile`: give a GPU machine's profile "
            "(this machine's from `edgemoe profile` on a CUDA build, or a bundled one)"
        )
    return expert_costs(ModelShape.read(path), load_profile(spec.profile))


def _sim_name(row: BenchRow, on_gpu: bool) -> str | None:
    """The simulator's configuration of a bench row (None: not modelled, e.g. the CPU stand-in cache)."""
    if row.name == "stock -ot exps=CPU":
        return "stock-ot-exps-cpu" if on_gpu else "stock-cpu"
    if row.name.startswith("stock --n-cpu-moe "):
        return "stock-n-cpu-moe-" + row.name.rsplit(" ", 1)[1]
    if row.name.endswith(" no-overlap") or " +assign " in row.name or " +precalc " in row.name:
        return None  # the overlap is assumed; no per-token assignment; pre-calculation: at its measured rates below
    if (
        row.name.startswith("edgemoe ") and on_gpu and not row.name.endswith(" dp")
    ):  # dp: equal slots only, so far
        return "edgemoe-" + row.name.split(" ", 1)[1]
    return None


def project(
    res: BenchResult,
    path: Path,
    spec: BenchSpec,
    base: LoadConfig,
    tokens: list[int],
    n_prompt: int,
    on_gpu: bool,
) -> None:
    """Each row's projection from this machine's profile: the routing of the generated tokens recorded as a
    trace and replayed by edgemoe.perf.model.simulate with the same budget."""
    from ..analysis.trace import join_traces, record_trace
    from .model.profile import load_profile
    from .model.simulate import SimSpec, simulate

    assert spec.profile is not None
    prof = load_profile(spec.profile)
    with Engine(path, base) as eng:
        # the measured runs start after a warm-up, whose loads the cache keeps: replayed first, not counted
        warm = eng.generate(tokens[:WARMUP_PROMPT], max_tokens=2, sampling=GREEDY, ignore_eog=True).tokens
        trace = join_traces(
            [
                record_trace(
                    eng,
                    tokens[:WARMUP_PROMPT] + warm[:1],
                    ctx=base.n_ctx,
                    mode="decode",
                    prefill_tokens=WARMUP_PROMPT,
                ),
                record_trace(eng, tokens, ctx=base.n_ctx, mode="decode", prefill_tokens=n_prompt),
            ]
        )
    sim_spec = SimSpec(
        vram=spec.vram if on_gpu else 0,
        n_ctx=base.n_ctx,
        n_ubatch=base.n_ubatch,
        warmup_seqs=1,
        # the performance model has no prefetcher: promoe is not projected
        policies=tuple(p for p in spec.policies if policy_spec(p).projected),
        calibration=spec.calibration,
        overlap=True,
        flash_attn=spec.flash_attn,
    )  # the edgemoe rows run overlapped
    sim = simulate(path, trace, prof, sim_spec)
    by_name = {c.name: c for c in sim.configs}
    at_own_ubatch = _own_ubatch_projections(res, path, trace, prof, sim_spec, set(by_name)) if on_gpu else {}
    for row in res.rows:
        c = at_own_ubatch.get(row.name)
        if c is None:
            key = _sim_name(row, on_gpu)
            if (
                key is None
                and on_gpu
                and spec.precalc_from is not None
                and row.name.endswith(f" +precalc {spec.precalc_from}")
            ):
                key = _project_precalc(row, path, trace, prof, spec, base, by_name)
            c = by_name.get(key) if key is not None else None
        if c is None or row.decode_tps <= 0:
            continue
        row.projected_decode_tps, row.projected_prefill_tps = c.decode_tps, c.prefill_tps
        row.projection_error = c.decode_tps / row.decode_tps - 1
    res.projection_note = f"projected with profile {spec.profile}" + (
        f"; {sim.workload_note}" if sim.workload_note else ""
    )


def _own_ubatch_projections(
    res: BenchResult, path: Path, trace: Any, prof: Any, sim_spec: Any, projected: set[str]
) -> dict[str, Any]:
    """The simulator's configuration of each GPU row that ran otherwise than `sim_spec` (whose configurations are
    `projected`) places it: stock at its best -ub with the --n-cpu-moe beside that buffer, +device prefill at its own
    -ub with the slots it ran. By row name: each projected at the ubatch it ran, not at the cached rows'."""
    from .model.simulate import simulate

    out: dict[str, Any] = {}
    stock_runs: dict[tuple[int, int | None], list[BenchRow]] = {}
    for row in res.rows:
        key = _sim_name(row, True)
        if (
            row.kind == "stock"
            and key is not None
            and (row.n_ubatch != sim_spec.n_ubatch or key not in projected)
        ):
            n_cpu = int(key.rsplit("-", 1)[1]) if key.startswith("stock-n-cpu-moe-") else None
            stock_runs.setdefault((row.n_ubatch, n_cpu), []).append(row)
    for (ub, n_cpu), rows in stock_runs.items():
        sim = simulate(path, trace, prof, replace(sim_spec, n_ubatch=ub, n_cpu_moe=n_cpu, policies=()))
        found = {c.name: c for c in sim.configs}
        out |= {r.name: found[k] for r in rows if (k := _sim_name(r, True)) in found}
    for row in res.rows:
        pol = row.name.split(" ")[1] if row.name.startswith("edgemoe ") else ""
        if not row.name.endswith(" +device prefill") or not row.cache or pol not in sim_spec.policies:
            continue
        slots = {int(il): int(n) for il, n in row.cache["slots_per_layer"].items()}
        pf_spec = replace(
            sim_spec, n_ubatch=row.n_ubatch, policies=(pol,), device_prefill=True, device_prefill_slots=slots
        )
        for c in simulate(path, trace, prof, pf_spec).configs:
            if c.name == f"edgemoe-{pol}-device-prefill":
                out[row.name] = c
    return out


def _project_precalc(
    row: BenchRow,
    path: Path,
    trace: Any,
    prof: Any,
    spec: BenchSpec,
    base: LoadConfig,
    by_name: dict[str, Any],
) -> str | None:
    """A "+precalc L" row's projection at the rates it measured (cache.precalc's early_share and precision): adds
    the simulator's configuration to by_name and returns its name (None: no rates, or a dp row)."""
    from .model.simulate import PrecalcSpec, SimSpec, simulate

    pc = (row.cache or {}).get("precalc") or {}
    pol = row.name.split(" ")[1]
    if row.name.split(" ")[2] == "dp" or not pc.get("early_share") or not pc.get("precision"):
        return None
    assert spec.precalc_from is not None
    sim = simulate(
        path,
        trace,
        prof,
        SimSpec(
            vram=spec.vram,
            n_ctx=base.n_ctx,
            n_ubatch=base.n_ubatch,
            warmup_seqs=1,
            policies=(pol,),
            calibration=spec.calibration,
            overlap=True,
            precalc=PrecalcSpec(spec.precalc_from, float(pc["early_share"]), float(pc["precision"])),
            flash_attn=spec.flash_attn,
        ),
    )
    key = f"edgemoe-{pol}-precalc"
    for c in sim.configs:  # the last config of that name
        if c.name == key:
            by_name[key] = c
    return key


def format_table(res: BenchResult) -> str:
    head = (
        f"{res.model} · {res.device} · budget {res.vram / 2**30:.1f} GiB · {res.slots_per_layer} slots/layer · "
        f"{res.prompt_tokens} prompt + {res.gen_tokens} generated tokens"
    )
    lines = [
        head,
        f"{'configuration':<26} {'ub':>5} {'prefill t/s':>11} {'decode t/s':>10} {'TTFT ms':>8} {'reuse ms':>8} "
        f"{'TPOT ms':>8} "
        f"{'VRAM GiB':>8} {'decode x':>8} {'prefill x':>9} {'hit rate':>8} {'proj dec':>8} {'err':>6} {'KLD':>7} "
        f"{'same top':>8}  note",
    ]
    for r in res.rows:
        vram = f"{r.peak_vram_bytes / 2**30:.2f}" if r.peak_vram_bytes is not None else "-"
        ratio = f"{r.ratio_decode:.3f}" if r.ratio_decode is not None else "-"
        pratio = f"{r.ratio_prefill:.3f}" if r.ratio_prefill is not None else "-"
        hit = f"{r.cache['hit_rate']:.3f}" if r.cache else "-"
        proj = f"{r.projected_decode_tps:.2f}" if r.projected_decode_tps is not None else "-"
        err = f"{r.projection_error:+.1%}" if r.projection_error is not None else "-"
        reuse = f"{r.reuse_ttft_s * 1e3:.0f}" if r.reuse_ttft_s is not None else "-"
        sp = r.speculation
        note = (
            f"accepted {sp['acceptance']:.0%}, {sp['tokens_per_step']:.2f} tok/step"
            + (f"; {r.note}" if r.note else "")
            if sp is not None
            else r.note
        )
        lines.append(
            f"{r.name:<26} {r.n_ubatch:>5} {r.prefill_tps:>11.1f} {r.decode_tps:>10.2f} {r.ttft_s * 1e3:>8.0f} {reuse:>8} "
            f"{r.tpot_s * 1e3:>8.1f} {vram:>8} {ratio:>8} {pratio:>9} {hit:>8} {proj:>8} {err:>6} "
            f"{kld_cells(r.kld)[0]:>7} {kld_cells(r.kld)[1]:>8}  {note}"
        )
    lines.append(
        f"reuse ms: TTFT of a second request on the same prefix with {REUSE_QUESTION} new tokens, its KV "
        "state restored from host memory (serve's prompt cache)"
    )
    lines.append(f"ub: the prefill ubatch (-ub) the row ran; {res.ubatch_note or 'llama.cpp default 512'}")
    if any(r.kld for r in res.rows):
        lines.append(
            "KLD, same top: against --kld's base, for the rows that change the output (perf.kld_column)"
        )
    if res.projection_note:
        lines.append(f"proj dec: PROJECTED decode tok/s, {res.projection_note}")
    elif any(r.kind for r in res.rows):
        lines.append(
            "proj dec: no profile of this machine (run `edgemoe profile` to see projections next to measurements)"
        )
    return "\n".join(lines)


def plot(res: BenchResult, out: Path) -> None:
    from .model.report import plot_speeds

    rows = [r for r in res.rows if r.decode_tps > 0]
    plot_speeds(rows, f"{res.model} · {res.device} · {res.vram / 2**30:.1f} GiB", out)
