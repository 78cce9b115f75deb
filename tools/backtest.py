#!/usr/bin/env python3
"""The performance model against published measurements (docs/research/performance-model.md, "Backtest").

Projects every row of edgemoe/perf/published/measurements.json on its machine profile and writes the tables
into docs/research/performance-model.md between their markers (decode rows: "backtest", prefill rows:
"backtest-prefill", the prefill rows at the fitted per-kind GPU rates: "backtest-prefill-fitted"), and the rows
as JSON:

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
from edgemoe.perf.model.backtest_prefill import (
    FITTED_RATES,
    backtest_prefill,
    load_published_prefill,
    prefill_error_stats,
    prefill_markdown,
)


def replace_between_markers(text: str, body: str, name: str = "backtest") -> str:
    """`text` with what lies between the `name` markers replaced by `body`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"the document has no {begin} ... {end} section to write the table into")
    return f"{head}{begin}\n{body}{end}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=Path, help="write the table between the backtest markers of this file")
    ap.add_argument("--json", type=Path, help="write every row, projected and published, as JSON")
    ap.add_argument("--shapes", type=Path,
                    help="directory for the header-only model files (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        projections = backtest(load_published(), args.shapes or Path(tmp))
        prefill = backtest_prefill(load_published_prefill(), args.shapes or Path(tmp))
        fitted = backtest_prefill(load_published_prefill(), args.shapes or Path(tmp), FITTED_RATES)
    table, prefill_table, fitted_table = markdown(projections), prefill_markdown(prefill), prefill_markdown(fitted)
    print(table)
    print(prefill_table)
    print(fitted_table)
    if args.docs:
        text = replace_between_markers(args.docs.read_text(), table)
        text = replace_between_markers(text, prefill_table, "backtest-prefill")
        args.docs.write_text(replace_between_markers(text, fitted_table, "backtest-prefill-fitted"))
    if args.json:
        rows = [{**p.row.__dict__, "projected_tps": p.projected_tps,
                 "projected_hit_rate": p.projected_hit_rate, "error": p.error, "routing": p.routing,
                 "bottleneck": p.bottleneck} for p in projections]
        prefill_rows = [{**p.row.__dict__, "projected_tps": p.projected_tps, "error": p.error, "bound": p.bound}
                        for p in prefill]
        args.json.write_text(json.dumps({"projected": True, "rows": rows, "stats": error_stats(projections),
                                         "prefill_rows": prefill_rows,
                                         "prefill_stats": prefill_error_stats(prefill),
                                         "prefill_fitted_rates": FITTED_RATES,
                                         "prefill_fitted_stats": prefill_error_stats(fitted)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
