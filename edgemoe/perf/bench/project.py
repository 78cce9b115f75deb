"""The projector of `edgemoe bench`: the routing of the generated tokens recorded as a trace and replayed by the
simulator (edgemoe.perf.model.simulate) with the bench's budget, each finished row projected as it ran (its
ubatch, its --n-cpu-moe, its slots, the pre-calculation rates it measured) beside its measurement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ...analysis.trace import Trace, join_traces, record_trace
from ...policies.registry import policy_spec
from ...runtime.engine import Engine
from ...runtime.sampling import GREEDY
from ..model.profile import MachineProfile, load_profile
from ..model.simulate import ConfigResult, PrecalcSpec, SimSpec, simulate
from .records import WARMUP_PROMPT, BenchResult, BenchRow, Projection, RowResult
from .rows import RowPlanner


def record_bench_trace(rp: RowPlanner, tokens: list[int], n_prompt: int) -> Trace:
    """The routing of the bench's tokens, decoded as the rows decoded them: the warm-up's first (replayed, not
    counted: the measured runs start after it, and the cache keeps its loads), then the measured run's."""
    load = rp.plan(None, rp.ubatches.cache).load
    with Engine(rp.header.path, load, header=rp.header) as eng:
        warm = eng.generate(tokens[:WARMUP_PROMPT], max_tokens=2, sampling=GREEDY, ignore_eog=True).tokens
        ctx = load.n_ctx
        first = tokens[:WARMUP_PROMPT] + warm[:1]
        return join_traces(
            [
                record_trace(eng, first, ctx=ctx, mode="decode", prefill_tokens=WARMUP_PROMPT),
                record_trace(eng, tokens, ctx=ctx, mode="decode", prefill_tokens=n_prompt),
            ]
        )


def bench_sim_spec(rp: RowPlanner) -> SimSpec:
    """The simulator's spec of the bench: its budget (0 without a GPU), context and ubatch, the policies the model
    can replay (not the prefetchers), with the overlap the edgemoe rows run."""
    spec = rp.spec
    return SimSpec(
        vram=spec.vram if rp.device is not None else 0,
        n_ctx=rp.n_ctx,
        n_ubatch=rp.ubatches.cache,
        warmup_seqs=1,
        policies=tuple(p for p in spec.policies if policy_spec(p).projected),
        calibration=spec.calibration,
        overlap=True,
        flash_attn=spec.flash_attn,
    )


def row_spec(base: SimSpec, p: Projection, result: RowResult) -> SimSpec | None:
    """The SimSpec that projects one row as it ran (None: a pre-calculation row without its measured rates)."""
    spec = replace(base, n_ubatch=p.n_ubatch, n_cpu_moe=p.n_cpu_moe)
    if p.policies is not None:
        spec = replace(spec, policies=tuple(x for x in p.policies if x in base.policies))
    if p.device_prefill_slots is not None:
        spec = replace(spec, device_prefill=True, device_prefill_slots=p.device_prefill_slots)
    if p.precalc_from is not None:
        pc = (result.cache or {}).get("precalc") or {}
        if not pc.get("early_share") or not pc.get("precision"):
            return None
        spec = replace(
            spec, precalc=PrecalcSpec(p.precalc_from, float(pc["early_share"]), float(pc["precision"]))
        )
    return spec


def projections(
    rows: Sequence[BenchRow], results: Sequence[RowResult], path: Any, trace: Trace, prof: MachineProfile,
    base: SimSpec,
) -> tuple[dict[str, ConfigResult], str]:  # fmt: skip
    """Each projected row's configuration by row name, one simulation per distinct spec the rows ran at, and the
    simulation's note on the workload."""
    wanted: list[tuple[SimSpec, list[tuple[str, str]]]] = []  # specs hold mappings: compared, not hashed
    for row, result in zip(rows, results, strict=True):
        if row.projection is None or result.decode_tps <= 0:
            continue
        spec = row_spec(base, row.projection, result)
        if spec is None:
            continue
        group = next((names for s, names in wanted if s == spec), None)
        if group is None:
            wanted.append((spec, group := []))
        group.append((row.name, row.projection.config))
    out: dict[str, ConfigResult] = {}
    note = ""
    for spec, names in wanted:
        sim = simulate(path, trace, prof, spec)
        found: Mapping[str, ConfigResult] = {c.name: c for c in sim.configs}
        out |= {name: found[config] for name, config in names if config in found}
        note = note or sim.workload_note
    return out, note


def project_rows(
    res: BenchResult, rows: Sequence[BenchRow], rp: RowPlanner, tokens: list[int]
) -> BenchResult:
    """`res` with each row's projection from the bench's profile, and what it was projected with."""
    assert rp.spec.profile is not None
    prof = load_profile(rp.spec.profile)
    trace = record_bench_trace(rp, tokens, rp.spec.prompt_tokens)
    found, note = projections(rows, res.rows, rp.header.path, trace, prof, bench_sim_spec(rp))
    projected = []
    for r in res.rows:
        c = found.get(r.name)
        if c is not None:
            r = replace(
                r, projected_decode_tps=c.decode_tps, projected_prefill_tps=c.prefill_tps,
                projection_error=c.decode_tps / r.decode_tps - 1,
            )  # fmt: skip
        projected.append(r)
    what = f"projected with profile {rp.spec.profile}" + (f"; {note}" if note else "")
    return replace(res, rows=tuple(projected), projection_note=what)
