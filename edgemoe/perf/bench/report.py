"""The printers of `edgemoe bench` (llama-bench's `printer` classes): the table, whose columns are a list a new
measurement appends one to (COLUMNS), one JSON object, and a PNG bar chart."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .kld_column import kld_cells
from .records import REUSE_QUESTION, BenchResult, RowResult


@dataclass(frozen=True)
class Column:
    """One column of the table: its header, its width and a row's cell ("-" where the row has no value)."""

    header: str
    width: int
    cell: Callable[[RowResult], str]


def _or_dash(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


COLUMNS: list[Column] = [
    Column("ub", 5, lambda r: str(r.n_ubatch)),
    Column("prefill t/s", 11, lambda r: f"{r.prefill_tps:.1f}"),
    Column("decode t/s", 10, lambda r: f"{r.decode_tps:.2f}"),
    Column("TTFT ms", 8, lambda r: f"{r.ttft_s * 1e3:.0f}"),
    Column("reuse ms", 8, lambda r: _or_dash(r.reuse_ttft_s, ".0f", 1e3)),
    Column("TPOT ms", 8, lambda r: f"{r.tpot_s * 1e3:.1f}"),
    Column("VRAM GiB", 8, lambda r: _or_dash(r.peak_vram_bytes, ".2f", 2**-30)),
    Column("decode x", 8, lambda r: _or_dash(r.ratio_decode, ".3f")),
    Column("prefill x", 9, lambda r: _or_dash(r.ratio_prefill, ".3f")),
    Column("hit rate", 8, lambda r: f"{r.cache['hit_rate']:.3f}" if r.cache else "-"),
    Column("proj dec", 8, lambda r: _or_dash(r.projected_decode_tps, ".2f")),
    Column("err", 6, lambda r: _or_dash(r.projection_error, "+.1%")),
]
# with `--kld`: each output-changing row's mean KL divergence and same-top rate (edgemoe.perf.bench.kld_column)
KLD_COLUMNS: list[Column] = [
    Column("KLD", 7, lambda r: kld_cells(r.metrics.get("kld"))[0]),
    Column("same top", 8, lambda r: kld_cells(r.metrics.get("kld"))[1]),
]
NAME_WIDTH = 26


def _note(r: RowResult) -> str:
    sp = r.speculation
    if sp is None:
        return r.note
    return f"accepted {sp['acceptance']:.0%}, {sp['tokens_per_step']:.2f} tok/step" + (
        f"; {r.note}" if r.note else ""
    )


def format_table(res: BenchResult, columns: list[Column] | None = None) -> str:
    """The result as a table: a heading, one line per row (its name, COLUMNS, its note), then what the columns
    that need it mean."""
    with_kld = any("kld" in r.metrics for r in res.rows)
    cols = (COLUMNS + (KLD_COLUMNS if with_kld else [])) if columns is None else columns
    head = (
        f"{res.model} · {res.device} · budget {res.vram / 2**30:.1f} GiB · {res.slots_per_layer} slots/layer · "
        f"{res.prompt_tokens} prompt + {res.gen_tokens} generated tokens"
    )
    lines = [
        head,
        f"{'configuration':<{NAME_WIDTH}} " + " ".join(f"{c.header:>{c.width}}" for c in cols) + "  note",
    ]
    for r in res.rows:
        cells = " ".join(f"{c.cell(r):>{c.width}}" for c in cols)
        lines.append(f"{r.name:<{NAME_WIDTH}} {cells}  {_note(r)}")
    lines.append(
        f"reuse ms: TTFT of a second request on the same prefix with {REUSE_QUESTION} new tokens, its KV "
        "state restored from host memory (serve's prompt cache)"
    )
    lines.append(f"ub: the prefill ubatch (-ub) the row ran; {res.ubatch_note or 'llama.cpp default 512'}")
    if with_kld:
        lines.append(
            "KLD, same top: against the KLD base's logits, for the rows that change the output (bench.kld_column)"
        )
    if res.projection_note:
        lines.append(f"proj dec: PROJECTED decode tok/s, {res.projection_note}")
    elif res.rows:
        lines.append(
            "proj dec: no profile of this machine (run `edgemoe profile` to see projections next to measurements)"
        )
    return "\n".join(lines)


def format_json(res: BenchResult) -> str:
    return json.dumps(res.to_dict(), indent=1)


def plot(res: BenchResult, out: Path) -> None:
    """Decode and prefill tok/s of the rows that ran, as a PNG bar chart."""
    from ..model.report import plot_speeds

    rows = [r for r in res.rows if r.decode_tps > 0]
    plot_speeds(rows, f"{res.model} · {res.device} · {res.vram / 2**30:.1f} GiB", out)
