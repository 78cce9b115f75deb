"""`edgemoe profile`'s curves: products timed per ggml type at two sizes, checked, then fitted.

Each (type, size, temperature) is timed over the token grid (edgemoe.perf.measure: every point the median
of at least 5 computes over at least MIN_SECONDS). The timings of a kind and temperature form a table that
edgemoe.perf.model.profile_checks checks; its suspects are timed twice more and settled (kept when reproduced,
repaired from their neighbours when not), and each type's two sizes are fitted to a fixed and a per-byte
part at every token count. Every timing holds a one-node graph's compute call and node dispatch
(CurveRun.overhead_s), which the model prices apart (the host fit's per-decode and per-node terms): it is taken
off the fixed parts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..model.profile import TOKEN_GRID, Curve, RatePoint, weights_per_byte
from ..model.profile_checks import CheckNote, Position, TimingTable, settle
from . import microbench as measure

EXPERT_SHAPES = ((512, 256), (2048, 768))  # (n_embd, n_ff): the second is Qwen3-30B-A3B's expert
MATMUL_SHAPES = ((512, 512), (2048, 2048))  # (ne0, ne1)
MIN_SECONDS = 0.03  # of computes per timed point (at least 5 of them)
REMEASURES = 2  # extra timings of a suspect point per round

ATTENTION_HEAD = 128  # row length of the attention products measured (a typical head size)
ATTENTION_ROWS = (256, 2048)  # cached tokens x heads of the two sizes


@dataclass(frozen=True)
class CurveRun:
    """Where and how a table is timed."""

    kind: str  # "expert" | "matmul"
    threads: int
    device: int | None  # None: the CPU backend
    pool_bytes: int | None  # cold pools' bytes (None: measure's default)
    overhead_s: float = 0.0  # a one-node graph's compute call and node dispatch, in every timing

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return EXPERT_SHAPES if self.kind == "expert" else MATMUL_SHAPES

    def nbytes(self, qtype: str, a: int, b: int) -> int:
        weights = 3 * a * b if self.kind == "expert" else a * b
        return int(round(weights / weights_per_byte(qtype)))

    def time(
        self, qtype: str, shape: tuple[int, int], counts: tuple[int, ...], hot: bool
    ) -> dict[int, float]:
        timer = measure.time_expert_ffn if self.kind == "expert" else measure.time_matmul
        return timer(
            qtype,
            *shape,
            counts,
            threads=self.threads,
            cold=not hot,
            device=self.device,
            min_seconds=MIN_SECONDS,
            pool_bytes=None if hot else self.pool_bytes,
        )


def _fit(
    small: Mapping[int, float],
    large: Mapping[int, float],
    b_small: int,
    b_large: int,
    overhead_s: float = 0.0,
) -> list[tuple[int, float, float]]:
    """(tokens, fixed_s, s_per_byte) from the times of two weight sizes at each token count, the fixed part
    without overhead_s (at least 0)."""
    out = []
    for c in sorted(small):
        slope = max((large[c] - small[c]) / (b_large - b_small), 1e-15)
        out.append((c, max(small[c] - slope * b_small - overhead_s, 0.0), slope))
    return out


def _curve(cold: list[tuple[int, float, float]], hot: list[tuple[int, float, float]]) -> Curve:
    return Curve(
        tuple(
            RatePoint(c, min(f, fh), s, min(sh, s)) for (c, f, s), (_, fh, sh) in zip(cold, hot, strict=False)
        )
    )


def by_bytes_per_weight(qtypes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(qtypes, key=lambda q: 1.0 / weights_per_byte(q)))


def measure_table(run: CurveRun, qtypes: tuple[str, ...], hot: bool, tick: Callable[[], None]) -> TimingTable:
    types = by_bytes_per_weight(qtypes)
    times = np.zeros((len(types), len(run.shapes), len(TOKEN_GRID)))
    for ti, q in enumerate(types):
        for si, shape in enumerate(run.shapes):
            t = run.time(q, shape, TOKEN_GRID, hot)
            times[ti, si] = [t[c] for c in TOKEN_GRID]
            tick()
    return TimingTable(
        kind=run.kind,
        hot=hot,
        types=types,
        sizes=tuple(f"{a}x{b}" for a, b in run.shapes),
        counts=TOKEN_GRID,
        nbytes=np.array([[run.nbytes(q, *s) for s in run.shapes] for q in types], float),
        times=times,
    )


def remeasurer(run: CurveRun, table: TimingTable) -> Callable[[list[Position]], dict[Position, list[float]]]:
    """settle's callback: REMEASURES new timings of each position, one timer call per curve and repeat."""

    def remeasure(positions: list[Position]) -> dict[Position, list[float]]:
        curves: dict[tuple[int, int], list[int]] = defaultdict(list)
        for ti, si, ci in positions:
            curves[(ti, si)].append(ci)
        out: dict[Position, list[float]] = defaultdict(list)
        for (ti, si), cis in curves.items():
            counts = tuple(table.counts[ci] for ci in cis)
            for _ in range(REMEASURES):
                t = run.time(table.types[ti], run.shapes[si], counts, table.hot)
                for ci in cis:
                    out[(ti, si, ci)].append(t[table.counts[ci]])
        return out

    return remeasure


def measure_curves(
    run: CurveRun, qtypes: tuple[str, ...], tick: Callable[[], None]
) -> tuple[dict[str, Curve], list[CheckNote], int]:
    """Each type's curve, the checks' notes, and how many points were timed again."""
    fits: dict[bool, dict[str, list[tuple[int, float, float]]]] = {}
    notes: list[CheckNote] = []
    remeasured = 0
    for hot in (False, True):
        table = measure_table(run, qtypes, hot, tick)
        inner = remeasurer(run, table)

        def counting(positions: list[Position], inner=inner) -> dict[Position, list[float]]:
            nonlocal remeasured
            remeasured += len(positions)
            return inner(positions)

        table, found = settle(table, counting)
        notes += found
        fits[hot] = {
            q: _fit(
                dict(zip(table.counts, table.times[ti, 0], strict=True)),
                dict(zip(table.counts, table.times[ti, 1], strict=True)),
                int(table.nbytes[ti, 0]),
                int(table.nbytes[ti, 1]),
                run.overhead_s,
            )
            for ti, q in enumerate(table.types)
        }
    curves = {q: _curve(fits[False][q], fits[True][q]) for q in qtypes}
    return curves, notes, remeasured


def measure_attention(
    *, threads: int, device: int | None, tick: Callable[[], None], overhead_s: float = 0.0
) -> Curve:
    """K^T q and V p as llama.cpp computes them without flash attention: F16 products with one head-sized row
    per (head, cached token); a curve per row, since short rows cost their dispatch more than their bytes.
    overhead_s: as CurveRun's."""
    times = [
        measure.time_matmul(
            "F16",
            ATTENTION_HEAD,
            rows,
            TOKEN_GRID,
            threads=threads,
            cold=False,
            device=device,
            min_seconds=MIN_SECONDS,
        )
        for rows in ATTENTION_ROWS
    ]
    tick()
    fit = _fit(times[0], times[1], *ATTENTION_ROWS, overhead_s)
    return Curve(tuple(RatePoint(c, f, s, s) for c, f, s in fit))
