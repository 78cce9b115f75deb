"""The performance model against published measurements: each row of edgemoe/perf/published/measurements.json
(a decode speed someone measured on a named consumer GPU, with its source and conditions) projected by the
simulator on that machine's specification profile and the model's shape, with the error of the projection.

Stock rows replay llama.cpp's `--n-cpu-moe N` placement (N at or above the model's MoE layers: every expert on
the CPU, as `-ot exps=CPU`); cache rows replay the fork's expert cache with edgemoe's residency policy of
the same kind (`static` for a cache filled from a routing profile, `lru` for one filled by recency), a miss run on
the CPU (`miss: cpu`) or copied to the GPU before the layer runs (`miss: load`). Forks and stock run a layer's
CPU and GPU branches in turn, as llama.cpp's scheduler does. `tools/backtest.py` writes the table that
docs/research/performance-model.md carries; tests/test_backtest.py checks that it regenerates.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ...analysis.routing_profile import profile_for_shape
from ...analysis.trace import DECODE, Trace
from ...policies.registry import policy_spec
from ...policies.residency import make_policy
from ...policies.residency import replay_policy as replay_residency
from .costmodel import ModelShape
from .profile import load_profile
from .shapes import shape_file, with_k_m_mix
from .simulate import Config, estimate_graph_nodes, run_config, static_frequency
from .workload import Workload, build_workload

# the decode replay: two sequences of a short prompt and 128 generated tokens, the first one warming the cache
PROMPT_TOKENS = 64
DECODE_TOKENS = 128
N_SEQ = 2
TARGETS = {"stock": 0.20, "cache": 0.25}  # the targets: median absolute error per kind of row


@dataclass(frozen=True)
class Published:
    """One published measurement (a row of measurements.json)."""

    id: str
    kind: str  # "stock" | "cache"
    model: str  # shape name (edgemoe.perf.model.shapes)
    quant: str
    profile: str  # bundled machine profile
    n_cpu_moe: int  # llama.cpp's --n-cpu-moe (>= the MoE layers: every expert on the CPU)
    published_tps: float
    source: str
    conditions: str
    policy: str | None = None  # cache rows: static | lru
    slots: int = 0  # cache rows: experts per layer
    miss: str = "cpu"  # cache rows: a miss runs on the CPU ("cpu") or is copied to the GPU first ("load")
    published_hit_rate: float | None = None
    n_ctx: int = 4096
    pageable_misses: bool = False  # "load" misses copied from pageable host memory (else pinned)
    host_routed: bool = False  # the host reads each cached layer's routing before its experts run


@dataclass(frozen=True)
class Projection:
    row: Published
    projected_tps: float
    projected_hit_rate: float | None
    routing: str  # the bundled routing profile the projection replayed ("~": the nearest to the shape)
    bottleneck: str

    @property
    def error(self) -> float:
        """Projected over published, less one (+0.10: projected 10% faster than measured)."""
        return self.projected_tps / self.row.published_tps - 1.0


def read_measurements(path: str | Path | None = None) -> dict[str, Any]:
    """The bundled measurements.json (or another file of the same format), parsed."""
    text = (
        Path(path).read_text()
        if path is not None
        else (resources.files("edgemoe.perf") / "published" / "measurements.json").read_text()
    )
    return dict(json.loads(text))


def load_published(path: str | Path | None = None) -> list[Published]:
    """The bundled decode measurements (or those of another file of the same format)."""
    return [Published(**r) for r in read_measurements(path)["rows"]]


def _qtype(quant: str) -> str:
    """The synthetic writer's --type for a published quantization (Q4_K_M -> Q4_K, MXFP4 stays)."""
    q = quant.upper()
    return q[:4] if q.startswith(("Q4_K", "Q5_K", "Q6_K")) else q


def _config(row: Published, moe: tuple[int, ...]) -> Config:
    gpu_layers = frozenset(moe[row.n_cpu_moe :])
    if row.kind == "stock":
        return Config(row.id, "stock", gpu_expert_layers=gpu_layers)
    cached = [il for il in moe if il not in gpu_layers]
    return Config(
        row.id,
        "edgemoe",
        gpu_expert_layers=gpu_layers,
        policy=row.policy,
        slots={il: row.slots for il in cached},
        blocking=row.miss == "load",
        pageable_loads=row.pageable_misses,
        host_routed=row.host_routed,
    )


def _places_by_frequency(row: Published) -> bool:
    """Does the row's policy place by router frequencies (static)? A cache placed from a profile of other text."""
    return row.policy is not None and policy_spec(str(row.policy)).frequency_phase is not None


def _decode_hit_rate(row: Published, cfg: Config, work: Workload, frequency: Any) -> float:
    """Routed slots of decode steps found resident before any load (a blocking load turns a miss into a GPU
    run, not a hit). LRU's residency is the same whether a miss loads before the layer or after the step."""
    slots = dict(cfg.slots)
    policy = make_policy(str(row.policy), slots, n_expert=work.n_expert, frequency=frequency)
    steps = [
        [(il, s.ids[:, j, :]) for j, il in enumerate(work.moe_layers) if il in slots] for s in work.steps
    ]
    counted = [s.phase == DECODE and s.seq >= 1 for s in work.steps]
    return replay_residency(policy, steps, counted).hit_rate


def routing_trace(n_expert: int, k: int, n_layer: int, seed: int = 0) -> tuple[Trace, str]:
    """The replayed routing: N_SEQ prompts drawn from the bundled routing profile of this shape (else the
    nearest, marked with a "~"), and the profile's name."""
    prof, exact = profile_for_shape(n_expert, k)
    trace = prof.synthesize(
        n_expert=n_expert,
        k=k,
        n_layer=n_layer,
        n_seq=N_SEQ,
        prefill=PROMPT_TOKENS,
        decode=DECODE_TOKENS,
        seed=seed,
    )
    return trace, prof.name if exact else f"~{prof.name}"


def project(
    row: Published, *, shape_dir: Path, trace_cache: dict[tuple[int, int, int], tuple[Trace, str]]
) -> Projection:
    model = shape_file(row.model, _qtype(row.quant), shape_dir)
    shape = with_k_m_mix(ModelShape.read(model), row.quant)
    prof = load_profile(row.profile)
    moe = shape.moe_layers
    key = (shape.n_expert, shape.n_expert_used, len(moe))
    if key not in trace_cache:
        trace_cache[key] = routing_trace(shape.n_expert, shape.n_expert_used, len(moe))
    trace, routing = trace_cache[key]
    work = build_workload(trace, moe, shape.n_expert, shape.n_expert_used)
    cfg = _config(row, moe)
    # a static cache is placed from a profile of other text: the warm-up prompt's routing, replayed on the next
    placed = Workload(tuple(s for s in work.steps if s.seq < 1), work.moe_layers, work.n_expert)
    frequency = static_frequency(placed) if _places_by_frequency(row) else None
    res = run_config(
        cfg, work, shape, prof, estimate_graph_nodes(shape), on_gpu=True, frequency=frequency, warmup_seqs=1
    )
    hit = _decode_hit_rate(row, cfg, work, frequency) if row.kind == "cache" else None
    return Projection(row, res.decode_tps, hit, routing, res.bottleneck)


def backtest(rows: Sequence[Published], shape_dir: Path) -> list[Projection]:
    cache: dict[tuple[int, int, int], tuple[Trace, str]] = {}
    return [project(r, shape_dir=shape_dir, trace_cache=cache) for r in rows]


def error_stats(projections: Sequence[Projection]) -> dict[str, dict[str, float]]:
    """Per kind of row: count, median and mean absolute error, the worst error (signed)."""
    out = {}
    for kind in ("stock", "cache"):
        errs = [p.error for p in projections if p.row.kind == kind]
        if errs:
            out[kind] = {
                "rows": len(errs),
                "median_abs_error": statistics.median(abs(e) for e in errs),
                "mean_abs_error": float(np.mean(np.abs(errs))),
                "worst_error": max(errs, key=abs),
                "target": TARGETS[kind],
            }
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown(projections: Sequence[Projection]) -> str:
    """The docs' table: one line per row, then the error statistics per kind."""
    lines = [
        (
            "| row | GPU profile | model (quant) | configuration | published tok/s | projected | error | "
            "hit rate published / projected | routing | source |"
        ),
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for p in projections:
        r = p.row
        if r.kind == "stock":
            conf = "`-ot exps=CPU`" if r.n_cpu_moe >= 99 else f"`--n-cpu-moe {r.n_cpu_moe}`"
        else:
            miss = "on the CPU" if r.miss == "cpu" else "loaded"
            conf = f"{r.policy} cache, {r.slots} experts/layer, miss {miss}"
        hit = f"{_pct(r.published_hit_rate)} / {_pct(p.projected_hit_rate)}" if r.kind == "cache" else "-"
        lines.append(
            f"| {r.id} | {r.profile} | {r.model} ({r.quant}) | {conf} | {r.published_tps:.1f} | "
            f"{p.projected_tps:.1f} | {100 * p.error:+.0f}% | {hit} | {p.routing} | {r.source} |"
        )
    lines.append("")
    for kind, s in error_stats(projections).items():
        lines.append(
            f"- **{kind} rows** ({s['rows']:.0f}): median absolute error "
            f"{100 * s['median_abs_error']:.1f}% "
            f"(target {100 * s['target']:.0f}%), mean {100 * s['mean_abs_error']:.1f}%, worst "
            f"{100 * s['worst_error']:+.0f}%"
        )
    return "\n".join(lines) + "\n"
