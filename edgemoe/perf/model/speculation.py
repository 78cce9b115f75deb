"""Speculative decoding in the performance model: what a verification step costs and when it pays.

A verification step decodes k + 1 positions (the last token and k proposals) in one ubatch, so each expert the
positions route to is read once: the simulator replays the trace's decode tokens k + 1 at a time
(SimSpec.verify) and prices the union. With a per-token acceptance rate a, a step yields on average
1 + a + a^2 + ... + a^k tokens (the proposals stand until the first rejection, then one token is sampled), so

    decode tok/s = expected_tokens(a, k) / (verification step seconds).

Speculation pays where that beats plain decoding; break_even() gives the acceptance rate where the two meet.
Prompt lookup costs nothing besides the step; a draft model's own decoding is not priced here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ACCEPTANCES = (0.5, 0.7, 0.9)


def expected_tokens(acceptance: float, draft: int) -> float:
    """Tokens one verification of `draft` proposals yields on average, each accepted with `acceptance`."""
    return sum(acceptance**i for i in range(draft + 1))


def break_even(cost_ratio: float, draft: int) -> float | None:
    """The acceptance rate at which speculation matches plain decoding, when a verification step costs
    `cost_ratio` plain steps (None: it never pays, the step costs more than draft + 1 tokens)."""
    if cost_ratio <= 1.0:
        return 0.0
    if cost_ratio >= draft + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, draft) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpeculationRow:
    """One configuration with and without speculation (projected)."""

    name: str
    draft: int
    plain_tps: float  # decode tok/s one token per step
    step_cost: float  # a verification step over a plain step
    tps: dict[float, float]  # acceptance -> decode tok/s with speculation
    break_even: float | None  # the acceptance where it starts to pay (None: never)
    hit_rate: float | None = None  # the cache's decode hit rate one token per step (None: no cache)
    verify_hit_rate: float | None = None  # ... per expert and verification step (a batch's union loads once)


def speculation_rows(
    plain: Sequence[tuple[str, float]],
    verified: Sequence[tuple[str, float]],
    draft: int,
    acceptances: Sequence[float] = ACCEPTANCES,
    hit_rates: dict[str, tuple[float | None, float | None]] | None = None,
) -> list[SpeculationRow]:
    """(name, decode tok/s) of each configuration at one token per step, and (name, positions per second) at
    draft + 1 per step (the simulator's decode_tps with SimSpec.verify = draft + 1): the rows, by name;
    `hit_rates`: name -> (decode hit rate one token per step, per verification step)."""
    fast = dict(verified)
    rows = []
    for name, tps in plain:
        pos = fast.get(name, 0.0)
        hits = (hit_rates or {}).get(name, (None, None))
        if tps <= 0 or pos <= 0:
            continue
        step_s = (draft + 1) / pos
        cost = step_s * tps
        rows.append(
            SpeculationRow(
                name=name,
                draft=draft,
                plain_tps=tps,
                step_cost=cost,
                tps={a: expected_tokens(a, draft) / step_s for a in acceptances},
                break_even=break_even(cost, draft),
                hit_rate=hits[0],
                verify_hit_rate=hits[1],
            )
        )
    return rows


def format_speculation(rows: Sequence[SpeculationRow], routing: str = "") -> str:
    """A table: each configuration's plain decode, the verification step's cost and speculative decode; `routing`:
    the trace it replayed, named in its title."""
    if not rows:
        return "speculation: no configuration to project"
    acc = sorted(rows[0].tps)
    head = f"  {'configuration':<34} {'plain':>7} {'step x':>7} " + " ".join(
        f"{'a=' + format(a, 'g'):>7}" for a in acc
    )
    lines = [
        f"PROJECTED decode tok/s with speculation ({rows[0].draft} proposals per step)"
        + (f" on {routing}:" if routing else ":"),
        head + f"  {'pays from':<9}  decode hit rate (one token / a verification)",
    ]
    for r in rows:
        pays = f"a >= {r.break_even:.2f}" if r.break_even is not None else "never"
        cells = " ".join(f"{r.tps[a]:>7.1f}" for a in acc)
        both = r.hit_rate is not None and r.verify_hit_rate is not None
        hits = f"{r.hit_rate:.3f} / {r.verify_hit_rate:.3f}" if both else "-"
        lines.append(f"  {r.name:<34} {r.plain_tps:>7.1f} {r.step_cost:>7.2f} {cells}  {pays:<9}  {hits}")
    return "\n".join(lines)


def project_speculation(
    model: Any,
    trace: Any,
    prof: Any,
    spec: Any,
    draft: int,
    acceptances: Sequence[float] = ACCEPTANCES,
    *,
    gating: Any = None,
    plain: Any = None,
) -> list[SpeculationRow]:
    """Simulate `spec` (a SimSpec; `gating` as simulate takes it) one token per step and draft + 1 per step on the
    same trace and profile, and turn the two into speculation rows; `plain`: the one-token-per-step SimResult
    where the caller has simulated it already."""
    from dataclasses import replace

    from .simulate import simulate

    if plain is None:
        plain = simulate(model, trace, prof, replace(spec, verify=1), gating=gating)
    verified = simulate(model, trace, prof, replace(spec, verify=draft + 1), gating=gating)
    by_name = {c.name: c for c in verified.configs}
    hits = {
        c.name: (c.decode_hit_rate, by_name[c.name].decode_hit_rate)
        for c in plain.configs
        if c.name in by_name
    }
    return speculation_rows(
        [(c.name, c.decode_tps) for c in plain.configs],
        [(c.name, c.decode_tps) for c in verified.configs],
        draft,
        acceptances,
        hits,
    )
