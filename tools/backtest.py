#!/usr/bin/env python3
"""The performance model against published measurements (docs/research/performance-model.md, "Backtest").

Projects every row of edgemoe/perf/published/measurements.json on its machine profile and writes the table
into docs/research/performance-model.md between its markers, and the rows as JSON:

    .venv/bin/python tools/backtest.py --docs docs/research/performance-model.md --json docs/figures/backtest.json
    .venv/bin/python tools/backtest.py            # print the table only
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.perf.model.backtest import backtest, error_stats, load_published, markdown

BEGIN, END = "<!-- backtest:begin -->", "<!-- backtest:end -->"


def replace_between_markers(text: str, body: str) -> str:
    """`text` with what lies between the backtest markers replaced by `body`."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"the document has no {BEGIN} ... {END} section to write the table into")
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=Path, help="write the table between the backtest markers of this file")
    ap.add_argument("--json", type=Path, help="write every row, projected and published, as JSON")
    ap.add_argument("--shapes", type=Path,
                    help="directory for the header-only model files (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        projections = backtest(load_published(), args.shapes or Path(tmp))
    table = markdown(projections)
    print(table)
    if args.docs:
        args.docs.write_text(replace_between_markers(args.docs.read_text(), table))
    if args.json:
        rows = [{**p.row.__dict__, "projected_tps": p.projected_tps,
                 "projected_hit_rate": p.projected_hit_rate, "error": p.error, "routing": p.routing,
                 "bottleneck": p.bottleneck} for p in projections]
        args.json.write_text(json.dumps({"projected": True, "rows": rows, "stats": error_stats(projections)},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
