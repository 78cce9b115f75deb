"""`edgemoe bench`: stock llama.cpp placements vs edgemoe's expert cache, one process, one run.

Stock configurations run through the same library with no hook and no cache, which builds llama.cpp's own graph.
Every row is a plan (edgemoe.perf.bench.rows); the runner opens it, sets its cache, its context steps and its
speculation, and measures it (llama-bench's `test`); every row gets the same prompt (fixed random token ids), the
same threads and the same greedy decode. Then the projector (edgemoe.perf.bench.project) runs the simulator over
the finished rows, and the printers (edgemoe.perf.bench.report) show them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import EdgeMoeError
from ...gguf.header import check_gguf
from ...gguf.info import ModelInfo, model_info
from ...plan.planner import Device, budget_request
from ...runtime import native
from ...runtime.engine import Engine
from ...runtime.generation import Generation
from ...runtime.sampling import GREEDY
from .project import project_rows
from .records import REUSE_QUESTION, WARMUP_PROMPT, BenchResult, BenchRow, RowResult
from .rows import BenchSpec, RowPlanner, bench_ctx, bench_rows, bench_ubatches

# more measurements of a row (e.g. a quality column): called with the engine after the timed generation and
# the generation; returns entries for the row's `metrics`
Probe = Callable[[Engine, BenchRow, Generation], Mapping[str, Any]]


def bench_prompt(info: ModelInfo, n: int) -> list[int]:
    """The prompt every row gets: n fixed random token ids."""
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


@dataclass(frozen=True)
class Runner:
    """Measures rows of one model with one prompt (llama-bench's `test`)."""

    path: Path
    prompt: list[int]
    gen_tokens: int
    device: Any = None  # the GPU device the caches go on (None: the CPU stand-in)
    probes: Sequence[Probe] = ()

    def setup(self, eng: Engine, row: BenchRow) -> None:
        """What the row sets on the opened engine: its expert cache, its context steps, its speculation."""
        if row.cache is not None:
            eng.enable_expert_cache(row.cache, device=self.device)
        if row.tiers is not None:
            eng.set_context_tiers(row.tiers)
        if row.speculation is not None:
            eng.set_speculation(row.speculation)

    def measure(self, row: BenchRow) -> tuple[RowResult, list[int]]:
        """The row's measurement (a row that cannot run, kept with why), and the tokens it generated."""
        if row.skip is not None:
            return _skipped(row, row.skip), []
        try:
            return self._measure(row)
        except Exception as err:  # noqa: BLE001 - one configuration failing (no calibration...) is a row
            return _skipped(row, str(err)), []

    def _measure(self, row: BenchRow) -> tuple[RowResult, list[int]]:
        dev, cfg = self.device, row.placement.load
        free0 = native.device_memory(dev)[0] if dev is not None else None
        with Engine(self.path, cfg) as eng:
            self.setup(eng, row)
            warm = self.prompt[:WARMUP_PROMPT]
            eng.generate(warm, max_tokens=2, sampling=GREEDY, ignore_eog=True)
            eng.reset()
            if eng.experts is not None:
                eng.experts.reset_stats()
            t0 = time.perf_counter()
            g = eng.generate(self.prompt, max_tokens=self.gen_tokens, sampling=GREEDY, ignore_eog=True)
            wall = time.perf_counter() - t0
            used = free0 - native.device_memory(dev)[0] if dev is not None and free0 is not None else None
            cache = None
            if eng.experts is not None:
                ex = eng.experts
                cache = {**ex.stats(), "prefill": ex.prefill_stats(), "precalc": ex.precalc_stats()}
            metrics = {k: v for p in self.probes for k, v in p(eng, row, g).items()}
            reuse = _reuse_ttft(eng, self.prompt)
        t = g.timings
        result = RowResult(
            row.name, row.kind, t.prompt_tps, t.decode_tps, t.ttft_s,
            1.0 / t.decode_tps if t.decode_tps > 0 else wall, used, cache, row.note,
            reuse_ttft_s=reuse, speculation=g.speculation.to_dict() if g.speculation is not None else None,
            n_ubatch=min(cfg.n_ubatch, cfg.n_batch, cfg.n_ctx or cfg.n_ubatch), metrics=metrics,
        )  # fmt: skip
        return result, g.tokens


def _skipped(row: BenchRow, why: str) -> RowResult:
    return RowResult(row.name, row.kind, 0.0, 0.0, 0.0, 0.0, None, note=f"skipped: {why}")


def stock_ratios(rows: Sequence[RowResult]) -> tuple[RowResult, ...]:
    """Each measured row with its speeds over the fastest stock row's."""
    stock = [r for r in rows if r.kind == "stock" and r.decode_tps > 0]
    if not stock:
        return tuple(rows)
    best_dec = max(r.decode_tps for r in stock)
    best_pre = max(r.prefill_tps for r in stock)
    return tuple(
        replace(r, ratio_decode=r.decode_tps / best_dec, ratio_prefill=r.prefill_tps / best_pre)
        if r.decode_tps > 0
        else r
        for r in rows
    )


def assign_costs(path: Path, spec: BenchSpec) -> dict[int, Any]:
    """The assigner's per-layer costs from the bench's profile (it must have a GPU)."""
    from ..model.costmodel import ModelShape, expert_costs
    from ..model.profile import load_profile

    if spec.profile is None:
        raise EdgeMoeError(
            "bench `assign` prices the assignment with `profile`: give a GPU machine's profile "
            "(this machine's from `edgemoe profile` on a CUDA build, or a bundled one)"
        )
    return expert_costs(ModelShape.read(path), load_profile(spec.profile))


def row_planner(path: Path, spec: BenchSpec, dev: Any) -> RowPlanner:
    """What the bench's rows share: the model, its context, the device, the ubatches and the assigner's costs."""
    from ..model.prefill_plan import ProfilePricing
    from ..model.profile import load_profile

    header = check_gguf(path)
    n_ctx = bench_ctx(spec)
    device = Device(native.device_name(dev)) if dev is not None else None
    pricing = None
    if dev is not None and spec.profile is not None and spec.n_ubatch is None:
        prof = load_profile(spec.profile)
        pricing = ProfilePricing(prof, prompt_tokens=spec.prompt_tokens) if prof.has_gpu else None
    ubs = bench_ubatches(header, spec, n_ctx, pricing)
    costs = assign_costs(path, spec) if spec.assign else None
    return RowPlanner(header, spec, n_ctx, device, ubs, pricing, costs)


def run_bench(
    path: Path,
    spec: BenchSpec,
    progress: Callable[[str], None] | None = None,
    probes: Sequence[Probe] = (),
) -> BenchResult:
    """Plan every row, measure each, project the finished ones (with a profile) and compare them with stock."""
    dev = native.gpu_device()
    rp = row_planner(path, spec, dev)
    info = model_info(rp.header)
    split = rp.plan(budget_request(spec.vram), rp.ubatches.cache)
    assert split.budget is not None  # a request with a budget has its split
    runner = Runner(path, bench_prompt(info, spec.prompt_tokens), spec.gen_tokens, dev, probes)
    results: list[RowResult] = []
    generated: list[int] = []
    rows = bench_rows(rp)
    for row in rows:
        if progress:
            progress(row.name)
        result, tokens = runner.measure(row)
        results.append(result)
        generated = generated or tokens
    res = BenchResult(
        model=path.name,
        device=native.device_name(dev) if dev is not None else "CPU (no GPU in this build)",
        vram=spec.vram,
        threads=spec.threads,
        prompt_tokens=spec.prompt_tokens,
        gen_tokens=spec.gen_tokens,
        slots_per_layer=split.budget.experts_per_layer,
        n_cpu_moe=split.n_cpu_moe,
        rows=tuple(results),
        ubatch_note=rp.ubatches.note,
    )
    if spec.kld_base is not None:
        from .kld_column import add_kld_column

        kld = add_kld_column(res.rows, rows, path, spec.kld_base, runner.setup, progress)
        res = replace(res, rows=kld)
    if spec.profile is not None and generated:
        if progress:
            progress("projection (trace + performance model)")
        res = project_rows(res, rows, rp, runner.prompt + generated[:-1])
    return replace(res, rows=stock_ratios(res.rows))
