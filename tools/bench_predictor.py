#!/usr/bin/env python3
"""Decode cost of expert predictors inside llama.cpp's graph, measured in one process.

  .venv/bin/python tools/bench_predictor.py MODEL [--gen 64] [--reps 5] [--threads 2] [--distance 2]
      [--n-out N] [--hidden H] [--weights f32 f16 q8_0] [--no-gate] [--json]

One Engine, one load. The variants run alternately (ABBA order), --reps times each after a warm-up run:
  off         no predictor: the model's own graph
  mlp-<w>     an MLP predictor for every target layer at --distance, weights stored as <w> (f32 computes as
              the numpy predictors do; f16 and q8_0 take fewer bytes), with random weights of the calibrated
              shape: hidden = mlp_hidden(n_embd), skip = a copy of the target's router (what a calibrated
              artifact holds), so a model without calibration (the synthetic qwen3-30b-a3b) can be measured
  gate        gate reuse: the target's own router on the source's router input (no weights of its own)
A run resets the context, prefills --prompt random tokens, then decodes --gen fixed random tokens one per
llama_decode (teacher-forced: the same work in every run) and times each decode. Printed per variant: the
median decode tok/s, the cost share 1 - tok/s / off's tok/s, and the predictors' device bytes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.predictors import MLPPredictor, Predictor, create_predictor, mlp_hidden, spec_for_model  # noqa: E402
from edgemoe.predictors.base import ModelSpec  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.prediction import WEIGHT_TYPES  # noqa: E402


def random_mlp(spec: ModelSpec, distance: int, hidden: int, seed: int) -> MLPPredictor:
    """An MLP predictor of the calibrated shape with random float16 weights and the routers as skip."""
    rng = np.random.default_rng(seed)
    n_targets = spec.n_layers - distance
    f16 = np.float16
    w1 = (rng.standard_normal((n_targets, spec.n_embd, hidden)) / np.sqrt(spec.n_embd)).astype(f16)
    b1 = (0.1 * rng.standard_normal((n_targets, hidden))).astype(np.float32)
    w2 = (0.1 * rng.standard_normal((n_targets, hidden, spec.n_expert)) / np.sqrt(hidden)).astype(f16)
    b2 = np.zeros((n_targets, spec.n_expert), np.float32)
    skip = np.stack([spec.router(t).T for t in range(distance, spec.n_layers)]).astype(f16)
    return MLPPredictor(spec, distance, w1, b1, w2, b2, skip)


def one_run(eng: Engine, prompt: list[int], tokens: list[int]) -> float:
    """Decode tok/s of `tokens` fed one per llama_decode after `prompt`."""
    eng.reset()
    eng.feed(prompt)
    spent = 0.0
    for tok in tokens:
        t0 = time.perf_counter()
        eng.feed([tok])
        spent += time.perf_counter() - t0
    return len(tokens) / spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--gen", type=int, default=64, help="decoded tokens per run")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per run")
    ap.add_argument("--reps", type=int, default=5, help="runs per variant (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--distance", type=int, default=2, help="predict layer l+d from layer l")
    ap.add_argument("--n-out", type=int, default=None, help="ids per token and target (default k + 2)")
    ap.add_argument("--hidden", type=int, default=None, help="MLP width (default mlp_hidden(n_embd))")
    ap.add_argument("--weights", nargs="+", default=["f32", "f16", "q8_0"], choices=sorted(WEIGHT_TYPES))
    ap.add_argument("--no-gate", action="store_true", help="leave out the gate-reuse variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object (runs included)")
    args = ap.parse_args()

    spec = spec_for_model(args.model)
    hidden = args.hidden or mlp_hidden(spec.n_embd)
    n_out = args.n_out or spec.k + 2
    variants: dict[str, tuple[list[Predictor], str]] = {"off": ([], "f32")}
    mlp = random_mlp(spec, args.distance, hidden, args.seed)
    for w in args.weights:
        variants[f"mlp-{w}"] = ([mlp], w)
    if not args.no_gate:
        variants["gate"] = ([create_predictor("gate", spec, args.distance)], "f32")

    rng = np.random.default_rng(args.seed)
    runs: dict[str, list[float]] = {v: [] for v in variants}
    nbytes: dict[str, int] = {}
    with Engine(args.model, LoadConfig(n_ctx=args.prompt + args.gen + 8, n_threads=args.threads)) as eng:
        prompt = rng.integers(0, eng.n_vocab, args.prompt).tolist()
        tokens = rng.integers(0, eng.n_vocab, args.gen).tolist()
        names = list(variants)
        for rep in range(args.reps + 1):  # rep 0 warms up
            for name in names if rep % 2 else names[::-1]:
                preds, weights = variants[name]
                eng.set_predictors(preds, n_out=n_out, weights=weights)
                nbytes[name] = eng.predictor_bytes()
                tps = one_run(eng, prompt, tokens)
                if rep > 0:
                    runs[name].append(tps)
        eng.set_predictors(None)

    med = {v: statistics.median(r) for v, r in runs.items()}
    out = {"model": str(args.model), "threads": args.threads, "gen": args.gen, "prompt": args.prompt,
           "reps": args.reps, "distance": args.distance, "n_out": n_out, "hidden": hidden,
           "targets": spec.n_layers - args.distance,
           "variants": {v: {"decode_tps": round(med[v], 3), "cost": round(1 - med[v] / med["off"], 4),
                            "predictor_bytes": nbytes[v], "runs": [round(x, 3) for x in runs[v]]}
                        for v in variants}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.model.name}: {out['targets']} target layers at d={args.distance}, top-{n_out}, "
          f"hidden {hidden}, {args.threads} threads, {args.gen} tokens x {args.reps} runs (median)")
    for v, r in out["variants"].items():
        print(f"  {v:10} {r['decode_tps']:10.2f} tok/s  cost {100 * r['cost']:6.2f}%  "
              f"{r['predictor_bytes'] / 2**20:9.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
