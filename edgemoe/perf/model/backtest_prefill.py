"""The prefill side of the backtest: published prompt-processing speeds (llama-bench ppN) of a model held whole
on one GPU, at the ubatch given (`prefill_rows` of edgemoe/perf/published/measurements.json), projected by the
prefill planner's replay (edgemoe.perf.model.prompt_replay) on that machine's profile, with the
error of the projection. Every expert is resident, so nothing is copied: the rows test the GPU's compute and
launch terms alone, the bound of every GPU-bound prefill row `edgemoe plan` prints. llama-bench prompts are
random tokens: the replay's routing is a random draw of each token's experts (`random_prompt_trace`), not text's.

`tools/backtest.py` writes the table that docs/research/performance-model.md carries ("Backtest of the prefill
compute"); tests/test_backtest.py checks that it regenerates.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...analysis.trace import PREFILL, Trace
from .backtest import read_measurements
from .costmodel import ModelShape
from .profile import MachineProfile, load_profile, with_kind_rates
from .prompt_replay import replay_prompt
from .shapes import shape_file, with_k_m_mix
from .sim.config import Config
from .simulate import estimate_graph_nodes
from .workload import Step, Workload, prompt_workload

LARGE_UBATCH = 512  # the smallest ubatch the prefill plan chooses among (prefill_plan.UBATCHES)
# the GPU rates the rows call for, per kind of product, as multiples of a specification profile's flops (half the
# dense FP16 tensor peak with FP32 accumulation): dense products 1.6x (80% of that peak: the Llama 3 8B rows),
# routed experts 0.8x (40%: gpt-oss-20b at -ub 1024 and 2048), attention 1.4x (70%: the rows at depth 32768).
# Fitted one kind at a time in that order, each on its rows with the kinds before it fitted; not in the bundled
# profiles (docs/research/performance-model.md, "Backtest of the prefill compute")
FITTED_RATES = (1.6, 0.8, 1.4)

# the synthetic writer's type for a published one: Q4_0 as Q4_K (both 4.5 bits per weight, and a spec profile
# prices a product by its weights per byte), a *_K_S or *_K_M mix as its main type
_PRICED_AS = {"Q4_0": "Q4_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K_M": "Q6_K"}


@dataclass(frozen=True)
class PublishedPrefill:
    """One published prefill measurement (a `prefill_rows` entry of measurements.json)."""

    id: str
    model: str  # shape name (edgemoe.perf.model.shapes)
    quant: str
    profile: str  # bundled machine profile
    n_ubatch: int  # llama.cpp's -ub
    prompt_tokens: int  # the prompt's length (llama-bench's ppN)
    published_tps: float
    source: str
    conditions: str
    depth: int = 0  # tokens already in the KV cache before the prompt (llama-bench's ppN@dD)


@dataclass(frozen=True)
class PrefillBacktest:
    row: PublishedPrefill
    projected_tps: float
    bound: str  # the resource the replay found busiest: "gpu", "host", ...

    @property
    def error(self) -> float:
        """Projected over published, less one (+0.10: projected 10% faster than measured)."""
        return self.projected_tps / self.row.published_tps - 1.0


def load_published_prefill(path: str | Path | None = None) -> list[PublishedPrefill]:
    """The bundled prefill measurements (or those of another file of the same format)."""
    return [PublishedPrefill(**r) for r in read_measurements(path).get("prefill_rows", [])]


def whole_model_shape(row: PublishedPrefill, shape_dir: Path, prof: MachineProfile) -> ModelShape:
    """The row's model shape; refuses one larger than the GPU of `prof`, the row's profile (the rows hold the
    whole model there)."""
    qtype = _PRICED_AS.get(row.quant.upper(), row.quant.upper())
    shape = with_k_m_mix(ModelShape.read(shape_file(row.model, qtype, shape_dir)), row.quant)
    gpu = prof.gpu
    if gpu is None or shape.total_bytes > gpu.mem_bytes:
        raise ValueError(
            f"row {row.id}: {row.model} ({row.quant}, {shape.total_bytes / 2**30:.1f} GiB) is not held whole by "
            f"profile {row.profile}'s GPU: a prefill row is a model on one GPU"
        )
    return shape


def random_prompt_trace(n_expert: int, k: int, n_layer: int, n_tokens: int, seed: int = 0) -> Trace:
    """A prompt of random tokens' routing, as llama-bench's ppN prompts are: each token's k experts drawn
    uniformly in every layer. Text's routing keeps to fewer experts per ubatch (the bundled routing profiles),
    which a small ubatch would read less of."""
    rng = np.random.default_rng(seed)
    draws = rng.random((n_tokens, n_layer, n_expert), dtype=np.float32)
    ids = np.argsort(draws, axis=-1)[..., :k].astype(np.int32)
    return Trace(
        tokens=np.zeros(n_tokens, np.int32),
        layers=np.arange(n_layer, dtype=np.int32),
        ids=ids,
        weights=np.full((n_tokens, n_layer, k), 1.0 / k, np.float32),
        phase=np.full(n_tokens, PREFILL, np.uint8),
        seq=np.zeros(n_tokens, np.int32),
        meta={"n_expert": n_expert, "model": "random tokens"},
    )


def project_prefill(
    row: PublishedPrefill,
    *,
    shape_dir: Path,
    trace_cache: dict[tuple[int, int, int, int], Trace],
    rates: tuple[float, float, float] | None = None,
) -> PrefillBacktest:
    """The row's prompt of random tokens, in ubatches of its -ub, through stock llama.cpp with every layer on
    the GPU; `rates`: the GPU's dense, expert and attention products at these multiples of its flops."""
    prof = load_profile(row.profile)
    shape = whole_model_shape(row, shape_dir, prof)
    moe = shape.moe_layers
    n, u = row.prompt_tokens, row.n_ubatch
    if moe:
        key = (shape.n_expert, shape.n_expert_used, len(moe), n)
        if key not in trace_cache:
            trace_cache[key] = random_prompt_trace(*key)
        work = prompt_workload(
            trace_cache[key], moe, shape.n_expert, shape.n_expert_used, n_tokens=n, n_ubatch=u
        )
    else:  # a dense model: no routing
        steps = (Step(PREFILL, 0, a, np.zeros((min(u, n - a), 0, 0), np.int32)) for a in range(0, n, u))
        work = Workload(tuple(steps), (), 0)
    if row.depth:
        work = Workload(
            tuple(Step(s.phase, s.seq, s.kv_len + row.depth, s.ids) for s in work.steps), moe, work.n_expert
        )
    cfg = Config("stock-ngl-99", "stock", gpu_expert_layers=frozenset(moe))
    if rates is not None:
        prof = with_kind_rates(prof, dense=rates[0], expert=rates[1], attention=rates[2])
    tps, _, bound = replay_prompt(shape, prof, cfg, work, nodes=estimate_graph_nodes(shape))
    return PrefillBacktest(row, tps, bound)


def backtest_prefill(
    rows: Sequence[PublishedPrefill], shape_dir: Path, rates: tuple[float, float, float] | None = None
) -> list[PrefillBacktest]:
    cache: dict[tuple[int, int, int, int], Trace] = {}
    return [project_prefill(r, shape_dir=shape_dir, trace_cache=cache, rates=rates) for r in rows]


def prefill_error_stats(projections: Sequence[PrefillBacktest]) -> dict[str, dict[str, float]]:
    """Count, median absolute error and the worst error (signed): of every row, and of the rows at the ubatches
    the prefill plan chooses among (LARGE_UBATCH and up)."""
    out = {}
    for name, keep in (("all", 0), ("large_ubatch", LARGE_UBATCH)):
        errs = [p.error for p in projections if p.row.n_ubatch >= keep]
        if errs:
            out[name] = {
                "rows": len(errs),
                "median_abs_error": statistics.median(abs(e) for e in errs),
                "worst_error": max(errs, key=abs),
            }
    return out


def prefill_markdown(projections: Sequence[PrefillBacktest]) -> str:
    """The docs' table: one line per row, then the error statistics."""
    lines = [
        "| row | GPU profile | model (quant) | prompt | -ub | published tok/s | projected | error | bound | source |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for p in projections:
        r = p.row
        lines.append(
            f"| {r.id} | {r.profile} | {r.model} ({r.quant}) | {r.prompt_tokens}{f'@d{r.depth}' if r.depth else ''} | "
            f"{r.n_ubatch} | "
            f"{r.published_tps:.1f} | {p.projected_tps:.1f} | {100 * p.error:+.0f}% | {p.bound} | {r.source} |"
        )
    lines.append("")
    labels = {"all": "every row", "large_ubatch": f"rows at -ub {LARGE_UBATCH} and up"}
    for name, s in prefill_error_stats(projections).items():
        lines.append(
            f"- **{labels[name]}** ({s['rows']:.0f}): median absolute error {100 * s['median_abs_error']:.1f}%, "
            f"worst {100 * s['worst_error']:+.0f}%"
        )
    return "\n".join(lines) + "\n"
