#!/usr/bin/env python3
"""Decode speed of edgemoe's Engine vs stock llama-cpp-python, same GGUF, same threads, one run.

  .venv/bin/python tools/bench_generate.py models/*.gguf [--gen 64] [--reps 3] [--threads 2] [--hooks] [--json]

Both sides generate greedily past end-of-generation tokens from the same
prompt; decode tokens/s counts the steps after the first token (the first
comes out of prefill). Runs alternate (stock, edgemoe, stock, ...) and the
median of --reps is reported with the ratio edgemoe/stock. --hooks adds two
edgemoe variants: a no-op Python MoE hook, and the trace recorder (ids,
weights and router inputs copied every layer). --gating MODE with --threshold T
or --target-reduction R adds adaptive top-k on decode tokens (dropped experts are
skipped by the expert matmuls, patch 0003) and reports the activation reduction.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402

from edgemoe.calibration.adaptive import MODES, GatingOptions, build_gating, default_calibration_dir  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402
from edgemoe.analysis.perplexity import ActivationCounter  # noqa: E402
from edgemoe.analysis.trace import TraceRecorder  # noqa: E402
from edgemoe.analysis.verify import FnPolicy  # noqa: E402

LAST_REDUCTION: list[object] = [None]  # the gate variant's activation counter (decode tokens)
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def stock_decode_tps(path: Path, n_gen: int, threads: int, n_ctx: int) -> tuple[float, float]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    ids = llm.tokenize(PROMPT.encode())
    t0 = time.perf_counter()
    gen = llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0)
    next(gen)  # prefill + first token
    t1 = time.perf_counter()
    for _ in range(n_gen - 1):
        next(gen)
    t2 = time.perf_counter()
    llm.close()
    return len(ids) / (t1 - t0), (n_gen - 1) / (t2 - t1)


def edgemoe_decode_tps(path: Path, n_gen: int, threads: int, n_ctx: int, hook: str = "none",
                       gating: GatingOptions | None = None) -> tuple[float, float]:
    with Engine(path, LoadConfig(n_ctx=n_ctx, n_threads=threads)) as eng:
        if hook == "gate" and gating is not None:
            counter = ActivationCounter(decode_only=True)
            opts = replace(gating, calibration=gating.calibration or default_calibration_dir(path))
            eng.set_policies([build_gating(eng, opts), counter])
            LAST_REDUCTION[0] = counter
        elif hook == "noop":
            eng.set_policies([FnPolicy(lambda r: None)])
        elif hook == "trace":
            eng.set_policies([TraceRecorder(gate_inputs=True)])
        g = eng.generate(PROMPT, max_tokens=n_gen, sampling=GREEDY, ignore_eog=True)
    return g.timings.prompt_tps, g.timings.decode_tps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--hooks", action="store_true", help="also time a no-op hook and the trace recorder")
    ap.add_argument("--gating", choices=[m for m in MODES if m != "off"], default=None,
                    help="also time adaptive top-k with this rule (decode tokens only); "
                         "needs --threshold or --target-reduction (the latter and fisher/empirical "
                         "need the model's calibration)")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--target-reduction", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = (["none", "noop", "trace"] if args.hooks else ["none"]) + (["gate"] if args.gating else [])
    gating = (GatingOptions(args.gating, threshold=args.threshold, target_reduction=args.target_reduction)
              if args.gating else None)
    rows = []
    for path in args.models:
        stock: list[tuple[float, float]] = []
        ours: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.reps):
            stock.append(stock_decode_tps(path, args.gen, args.threads, args.ctx))
            for v in variants:
                ours[v].append(edgemoe_decode_tps(path, args.gen, args.threads, args.ctx, v, gating))
        s = statistics.median(d for _, d in stock)
        row = {"model": path.name, "threads": args.threads, "gen_tokens": args.gen,
               "stock_decode_tps": round(s, 2),
               "stock_prompt_tps": round(statistics.median(p for p, _ in stock), 1)}
        for v in variants:
            key = "edgemoe" if v == "none" else f"edgemoe_{v}_hook"
            o = statistics.median(d for _, d in ours[v])
            row[f"{key}_decode_tps"] = round(o, 2)
            row[f"{key}_ratio"] = round(o / s, 3)
            row[f"{key}_prompt_tps"] = round(statistics.median(p for p, _ in ours[v]), 1)
        if "gate" in variants:
            c = LAST_REDUCTION[0]
            row["gating"] = {"mode": args.gating, "threshold": args.threshold,
                             "target_reduction": args.target_reduction}
            row["gate_decode_activation_reduction"] = round(1 - c.kept / c.full, 3) if c.full else None
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        keys = ["edgemoe"] + ([f"edgemoe_{v}_hook" for v in variants[1:]])
        print(f"{'model':<40} {'stock tok/s':>12} " + " ".join(f"{k + ' (ratio)':>26}" for k in keys))
        for r in rows:
            print(f"{r['model']:<40} {r['stock_decode_tps']:>12.2f} " + " ".join(
                f"{r[k + '_decode_tps']:>17.2f} ({r[k + '_ratio']:.3f})" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
