#!/usr/bin/env python3
"""A machine profile whose GPU runs dense products, routed experts and attention at the rates the prefill backtest
fitted on published measurements (edgemoe.perf.model.backtest_prefill.FITTED_RATES; docs/research/
performance-model.md, "Backtest of the prefill compute"), for `plan`, `simulate` and `bench --profile`:

    .venv/bin/python tools/kind_rates_profile.py rtx4060-laptop --out .build/rtx4060-laptop-fitted.json
    .venv/bin/edgemoe plan MODEL --vram 8GiB --profile .build/rtx4060-laptop-fitted.json --prompt-tokens 8192
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.perf.model.backtest_prefill import FITTED_RATES
from edgemoe.perf.model.profile import load_profile, with_kind_rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a bundled profile's name or a profile file")
    ap.add_argument("--out", type=Path, required=True, help="where to write the scaled profile")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in FITTED_RATES),
                    help="dense, expert and attention multiples of the GPU's flops (default: %(default)s)")
    args = ap.parse_args()
    try:
        dense, expert, attention = (float(x) for x in args.rates.split(","))
    except ValueError:
        raise SystemExit(f"--rates takes three numbers separated by commas, not {args.rates!r}") from None
    prof = load_profile(args.profile)
    if prof.gpu is None:
        raise SystemExit(f"profile {args.profile!r} has no GPU: nothing to scale")
    print(with_kind_rates(prof, dense=dense, expert=expert, attention=attention).save(args.out))


if __name__ == "__main__":
    main()
