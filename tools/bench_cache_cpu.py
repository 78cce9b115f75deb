#!/usr/bin/env python3
"""CPU cost of the expert cache's split execution, against the same library without it, one run.

  .venv/bin/python tools/bench_cache_cpu.py MODEL... [--gen 64] [--reps 3] [--threads 2] [--slots 8]
                                             [--variants VARIANT...] [--json OUT]

Decode tokens/s (median of --reps, runs interleaved) for:
  stock            llama.cpp's graph, CPU weight repacking on (its default)
  stock-plain      the same without repacking (what the cache needs: experts copied from plain tensors)
  empty-callback   --slots slots per layer, nothing loaded (manual policy), ids mapped by the C routing
                   callback at every MoE layer (a scheduler stop each), every expert on the CPU branch
  empty-cache      the same with the expert-to-slot tables in the graph (no stop)
  lru-hook         --slots slots, lru run by the Python policy in the routing hook (a stop and a Python
                   call per MoE layer; the stand-in cache computes on the CPU)
  lru              --slots slots, lru in the graph (tables; native LRU after each step)
  dali-hook        --slots slots, DALI's replacement run by the Python DaliPolicy in the routing hook
  dali             --slots slots, DALI's replacement in the graph (tables; native DALI after each step)
  promoe-hook      --slots slots, ProMoE's prefetcher run by the Python PromoePolicy in the routing hook (the
                   calibration's predictor in numpy; gate reuse without one)
  promoe           --slots slots, ProMoE's prefetcher inside llama.cpp (the predictor in the graph, a
                   stop per cached layer, no Python)
(--variants picks some; stock always runs.)
Ratios are against `stock`. On a CPU-only build the cache device is a CPU buffer: no speedup is possible,
this measures what the split costs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.verify import FnPolicy  # noqa: E402
from edgemoe.runtime import native  # noqa: E402
from edgemoe.runtime.cache_config import CacheConfig, policy_config  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
VARIANTS = ("stock", "stock-plain", "empty-callback", "empty-cache", "lru-hook", "lru", "dali-hook", "dali",
            "promoe-hook", "promoe")


def decode_tps(path: Path, variant: str, gen: int, threads: int, slots: int) -> float:
    plain = variant == "stock-plain"
    with Engine(path, LoadConfig(n_ctx=512, n_threads=threads, use_extra_bufts=not plain)) as eng:
        if variant != "stock" and variant != "stock-plain":
            policy = "manual" if variant.startswith("empty") else variant.removesuffix("-hook")
            options = {"native": variant == "promoe"} if policy == "promoe" else {}
            eng.enable_expert_cache(CacheConfig(slots, policy=policy_config(policy, **options)))
        if variant == "empty-callback":
            assert eng.experts is not None
            eng.experts.set_mode(native.MOE_CACHE_POLICY_CALLBACK)
        if variant.endswith("-hook") and policy != "promoe":
            eng.set_policies([FnPolicy(lambda r: None)])  # a Python policy takes the cache into the hook
        g = eng.generate(PROMPT, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
    return g.timings.decode_tps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS[1:],
                    default=["stock-plain", "empty-callback", "empty-cache", "lru-hook", "lru"])
    ap.add_argument("--json", type=Path, help="also write the rows (with every run) here")
    args = ap.parse_args()
    variants = ["stock", *args.variants]
    rows = []
    for path in args.models:
        runs: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for v in variants:
                runs[v].append(decode_tps(path, v, args.gen, args.threads, args.slots))
        med = {v: statistics.median(r) for v, r in runs.items()}
        row = {"model": path.name, "threads": args.threads, "slots": args.slots,
               **{f"{v}_decode_tps": round(med[v], 2) for v in variants},
               **{f"{v}_ratio": round(med[v] / med["stock"], 3) for v in variants[1:]}}
        rows.append({**row, "reps": args.reps, "gen": args.gen, "runs": runs})
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
