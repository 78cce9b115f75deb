"""Consistency checks of `edgemoe profile`'s timing tables: pure functions over arrays.

A `TimingTable` holds the seconds of one kind of product (an expert FFN or a dense matmul) at one temperature
(cold or hot): ``times[type, size, count]``, types in ascending bytes per weight, two weight sizes, token
counts ascending. What these products guarantee, each within a tolerance (kernels switch paths):

- more tokens never cost less (monotone in the token count);
- the larger weight costs more than the smaller one, but not more per byte (the two-size fit's fixed cost
  is not negative and its per-byte slope is positive);
- where the product is memory-bound (cold weights, a few tokens), a type with fewer bytes per weight is
  not slower than one with more. At large token counts the kernels' arithmetic decides, and this CPU measures Q8_0 and
  repacked Q4_K experts at 2.5-4x Q5_K's time at 64-512 tokens, reproducibly: no order is checked there.

Noise on a shared machine only slows a run down, so the slower side of a contradiction is the suspect.
`settle` re-measures suspects and decides: a reading that goes away was noise; one the re-measurements
reproduce is the kernel's (kept, with a note); one that stays contradictory without reproducing is repaired
from its neighbours in the same curve (with a note).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

Position = tuple[int, int, int]  # (type, size, count) indices into TimingTable.times


@dataclass(frozen=True)
class Tolerances:
    # a token count may take this share longer than a larger one (kernel paths: Q5_K experts of 512x256 take
    # 27% longer at 4 tokens than at 8 on the Xeon of docs/figures/profile-dev-cpu.json)
    monotone: float = 0.35
    # the larger weight may cost this share more per byte than the smaller (hot weights: L2 against L3)
    size: float = 1.0
    # a type may take this share longer than a type with more bytes per weight (Q5_K's products at 1 token:
    # 1.5x Q6_K's on that Xeon; at 4 tokens 1.5x Q8_0's, so only the counts up to 2 are checked)
    type_order: float = 0.75
    type_order_max_tokens: int = 2  # the memory-bound counts the type order is checked at
    # readings of one point that agree within this share reproduce it (a kernel's time, not noise)
    stable: float = 0.15


@dataclass(frozen=True)
class TimingTable:
    """Seconds of one kind of product at one temperature."""

    kind: str  # "expert" | "matmul"
    hot: bool
    types: tuple[str, ...]  # ascending bytes per weight
    sizes: tuple[str, ...]  # labels of the weight shapes, smaller first ("512x256", "2048x768")
    counts: tuple[int, ...]  # ascending token counts
    nbytes: np.ndarray  # (n_type, n_size): weight bytes of one product
    times: np.ndarray  # (n_type, n_size, n_count): seconds

    def where(self, pos: Position) -> str:
        ti, si, ci = pos
        temp = "hot" if self.hot else "cold"
        return f"{self.types[ti]} {self.kind} {self.sizes[si]} ({temp}) at {self.counts[ci]} tokens"


@dataclass(frozen=True)
class Suspect:
    pos: Position
    reason: str


@dataclass(frozen=True)
class CheckNote:
    """A timing the checks questioned and what became of it (kept in the profile JSON)."""

    kind: str
    qtype: str
    size: str
    hot: bool
    tokens: int
    readings_s: tuple[float, ...]  # every reading of the point, the first one first
    value_s: float  # the time the curve uses
    action: str  # "confirmed" (reproduced: kept) | "repaired" (from its neighbours in the curve)
    reason: str


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms"


def monotone_suspects(table: TimingTable, tol: float) -> list[Suspect]:
    """Points slower by more than `tol` than some larger token count of the same curve."""
    out = []
    for ti, si in np.ndindex(*table.times.shape[:2]):
        t = table.times[ti, si]
        for ci in range(len(t) - 1):
            later = int(ci + 1 + np.argmin(t[ci + 1 :]))
            if t[ci] > (1 + tol) * t[later]:
                reason = f"{_ms(t[ci])}, more than {_ms(t[later])} at {table.counts[later]} tokens"
                out.append(Suspect((ti, si, ci), reason))
    return out


def size_suspects(table: TimingTable, tol: float) -> list[Suspect]:
    """The two-size fit's contradictions: the smaller weight as slow as the larger (a slope <= 0: the smaller is
    the suspect), or the larger dearer per byte by more than `tol` (a negative fixed cost: the larger is)."""
    if table.times.shape[1] != 2:
        return []
    out = []
    for ti, ci in np.ndindex(table.times.shape[0], table.times.shape[2]):
        ts, tl = table.times[ti, 0, ci], table.times[ti, 1, ci]
        bs, bl = table.nbytes[ti]
        if tl <= ts:
            out.append(
                Suspect((ti, 0, ci), f"{_ms(ts)}, not less than the {table.sizes[1]} weight's {_ms(tl)}")
            )
        elif tl / bl > (1 + tol) * ts / bs:
            ratio = (tl / bl) / (ts / bs)
            out.append(
                Suspect((ti, 1, ci), f"{_ms(tl)}, {ratio:.1f}x the {table.sizes[0]} weight's time per byte")
            )
    return out


def type_order_suspects(table: TimingTable, tol: float, max_tokens: int) -> list[Suspect]:
    """At token counts up to `max_tokens`, a type slower by more than `tol` than a type with more bytes per
    weight (the same shape and token count)."""
    out = []
    n_type = table.times.shape[0]
    for si, ci in np.ndindex(table.times.shape[1], table.times.shape[2]):
        if table.counts[ci] > max_tokens:
            continue
        for i in range(n_type):
            for j in range(i + 1, n_type):
                ti, tj = table.times[i, si, ci], table.times[j, si, ci]
                if ti > (1 + tol) * tj:
                    reason = f"{_ms(ti)}, {ti / tj:.1f}x {table.types[j]}'s, which has more bytes per weight"
                    out.append(Suspect((i, si, ci), reason))
                    break
    return out


def find_suspects(table: TimingTable, tol: Tolerances | None = None) -> list[Suspect]:
    """Every point some check questions, once each (the first reason found), in table order. The type order is
    checked on cold tables only: hot weights are read from the cache, and the kernels' arithmetic decides."""
    tol = tol or Tolerances()
    bad = ~np.isfinite(table.times) | (table.times <= 0)
    found: dict[Position, str] = {
        (int(a), int(b), int(c)): "not a positive finite time" for a, b, c in np.argwhere(bad)
    }
    if not bad.any():
        for s in (
            monotone_suspects(table, tol.monotone)
            + size_suspects(table, tol.size)
            + ([] if table.hot else type_order_suspects(table, tol.type_order, tol.type_order_max_tokens))
        ):
            found.setdefault(s.pos, s.reason)
    return [Suspect(p, r) for p, r in sorted(found.items())]


def _interpolate(counts: tuple[int, ...], t: np.ndarray, ok: np.ndarray, ci: int) -> float | None:
    """The curve's time at counts[ci] from its good points: log-log between the nearest on either side; flat
    below the first good point; above the last, the slope of the last two good ones (0 to 1 in log-log)."""
    lo = [i for i in range(ci) if ok[i]]
    hi = [i for i in range(ci + 1, len(t)) if ok[i]]
    x = math.log(counts[ci])
    if lo and hi:
        a, b = lo[-1], hi[0]
        xa, xb = math.log(counts[a]), math.log(counts[b])
        w = (x - xa) / (xb - xa)
        return math.exp((1 - w) * math.log(t[a]) + w * math.log(t[b]))
    if hi:
        return float(t[hi[0]])
    if len(lo) >= 2:
        a, b = lo[-2], lo[-1]
        slope = (math.log(t[b]) - math.log(t[a])) / (math.log(counts[b]) - math.log(counts[a]))
        return float(t[b]) * (counts[ci] / counts[b]) ** min(max(slope, 0.0), 1.0)
    return float(t[lo[0]]) if lo else None


def repair(table: TimingTable, positions: set[Position]) -> np.ndarray:
    """The table's times with each position replaced from the good points of its own curve; a curve with no
    good point takes the other types' times at that point scaled by bytes (their median)."""
    times = table.times.copy()
    ok = np.ones(times.shape, bool)
    for p in positions:
        ok[p] = False
    for ti, si, ci in sorted(positions):
        value = _interpolate(table.counts, table.times[ti, si], ok[ti, si], ci)
        if value is None:
            others = [
                table.times[tj, si, ci] * table.nbytes[ti, si] / table.nbytes[tj, si]
                for tj in range(times.shape[0])
                if ok[tj, si, ci]
            ]
            value = float(np.median(others)) if others else float(times[ti, si, ci])
        times[ti, si, ci] = value
    return times


Remeasure = Callable[[list[Position]], Mapping[Position, list[float]]]


def _reproduced(readings: list[float], tol: float) -> bool:
    return len(readings) >= 2 and max(readings) <= (1 + tol) * min(readings)


def settle(
    table: TimingTable, remeasure: Remeasure, tol: Tolerances | None = None, rounds: int = 2
) -> tuple[TimingTable, list[CheckNote]]:
    """Check the table, re-measure its suspects (`remeasure(positions)` returns new readings of each) and take
    each point's median reading, for up to `rounds` rounds; then keep the suspects whose readings agree within
    `tol.stable` (note "confirmed") and repair the rest from their neighbours (note "repaired")."""
    tol = tol or Tolerances()
    readings: dict[Position, list[float]] = {}
    suspects = find_suspects(table, tol)
    for _ in range(rounds):
        todo = [s.pos for s in suspects if not _reproduced(readings.get(s.pos, []), tol.stable)]
        if not todo:
            break
        new = remeasure(todo)
        times = table.times.copy()
        for p in todo:
            readings.setdefault(p, [float(table.times[p])]).extend(new.get(p, []))
            times[p] = float(np.median(readings[p]))
        table = dataclasses.replace(table, times=times)
        suspects = find_suspects(table, tol)
    notes, broken = [], set()
    for s in suspects:
        rs = readings.get(s.pos, [float(table.times[s.pos])])
        action = "confirmed" if _reproduced(rs, tol.stable) else "repaired"
        if action == "repaired":
            broken.add(s.pos)
        notes.append((s, rs, action))
    fixed = repair(table, broken)
    out = [
        CheckNote(
            kind=table.kind,
            qtype=table.types[s.pos[0]],
            size=table.sizes[s.pos[1]],
            hot=table.hot,
            tokens=table.counts[s.pos[2]],
            readings_s=tuple(rs),
            value_s=float(fixed[s.pos]),
            action=action,
            reason=s.reason,
        )
        for s, rs, action in notes
    ]
    return dataclasses.replace(table, times=fixed), out
