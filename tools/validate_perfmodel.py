#!/usr/bin/env python3
"""Validate the performance model on this machine: measured vs projected CPU-only speeds.

For each model: a prompt from the Shakespeare corpus's training part, greedy generation; measured
prefill and decode tokens/s of llama.cpp's own graph ("stock": no edgemoe feature, driven by the
Engine loop as `edgemoe bench` does) and of edgemoe's adaptive top-k in the graph ("edgemoe gated");
edgemoe without gating runs exactly stock's graph (so its row is the stock measurement's second
reading). The routing of the same tokens is recorded as a trace and `edgemoe simulate`'s model
projects each configuration from this machine's profile (`edgemoe profile`). Prints a table and,
with --json, writes every figure.

    .venv/bin/edgemoe profile
    .venv/bin/python tools/validate_perfmodel.py models/edgemoe-tiny-qwen3moe.Q4_K_M.gguf \
        models/edgemoe-tiny-mixtral.Q4_K_M.gguf .build/synth/qwen3-30b-a3b.Q4_K.gguf --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe import GREEDY, Engine, LoadConfig  # noqa: E402
from edgemoe.analysis.trace import record_trace  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402
from edgemoe.perf.measure.profiling import default_profile_path  # noqa: E402
from edgemoe.perf.model.profile import load_profile  # noqa: E402
from edgemoe.perf.model.simulate import SimSpec, simulate  # noqa: E402
from edgemoe.perf.model.workload import GatingSpec  # noqa: E402
from edgemoe.policies.gating import GatingPolicy, GatingRule  # noqa: E402


def prompt_tokens(eng: Engine, n: int, *, heldout: bool = False) -> list[int]:
    """The first n tokens of the Shakespeare corpus's training part (heldout: of its held-out part)."""
    split = split_corpus(default_corpus_dir() / "tinyshakespeare.txt")
    text = split.heldout_text() if heldout else split.train_text()
    ids = eng.tokenize(text[: 20 * n])
    if len(ids) < n:
        raise SystemExit(f"the corpus gives only {len(ids)} tokens")
    return ids[:n]


def measure(eng: Engine, prompt: list[int], gen: int, reps: int) -> tuple[float, float, list[int]]:
    """Median (prefill tok/s, decode tok/s) of `reps` greedy generations after a warm-up, and the tokens."""
    eng.generate(prompt, max_tokens=8, sampling=GREEDY, ignore_eog=True)  # page faults, graph build
    pre, dec, out = [], [], []
    for _ in range(reps):
        eng.reset()
        g = eng.generate(prompt, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
        pre.append(g.timings.prompt_tps)
        dec.append(g.timings.decode_tps)
        out = g.tokens
    return statistics.median(pre), statistics.median(dec), out


def validate(path: Path, args: argparse.Namespace, prof: Any) -> dict[str, Any]:
    n_ctx = (args.prompt_tokens + args.gen + 255) // 256 * 256
    gate = GatingSpec(GatingRule(args.gating), args.threshold)
    with Engine(path, LoadConfig(n_ctx=n_ctx, n_threads=args.threads)) as eng:
        prompt = prompt_tokens(eng, args.prompt_tokens)
        stock = measure(eng, prompt, args.gen, args.reps)
        identity = measure(eng, prompt, args.gen, args.reps)
        assert eng.set_gating(GatingPolicy(gate.rule, gate.threshold)) == "graph"
        gated = measure(eng, prompt, args.gen, args.reps)
        report = eng.gating_report() or {}
        eng.set_gating(None)
        trace = record_trace(eng, prompt + stock[2][:-1], ctx=n_ctx, mode="decode", prefill_tokens=len(prompt))
    if args.save_traces is not None:
        args.save_traces.mkdir(parents=True, exist_ok=True)
        trace.save(args.save_traces / f"{path.name.split('.')[0]}.npz")
    sim = simulate(path, trace, prof, SimSpec(vram=0, n_ctx=n_ctx, n_ubatch=512, gated=True), gating=gate)
    proj = {c.name: c for c in sim.configs}
    rows = []
    for name, meas, key in (("stock", stock, "stock-cpu"), ("edgemoe, no gating", identity, "edgemoe-cpu"),
                            (f"edgemoe gated ({gate.label})", gated, "edgemoe-cpu-gated")):
        p = proj[key]
        rows.append({"config": name, "measured_prefill_tps": meas[0], "projected_prefill_tps": p.prefill_tps,
                     "prefill_error": p.prefill_tps / meas[0] - 1, "measured_decode_tps": meas[1],
                     "projected_decode_tps": p.decode_tps, "decode_error": p.decode_tps / meas[1] - 1})
    return {"model": path.name, "prompt_tokens": len(prompt), "gen_tokens": args.gen, "reps": args.reps,
            "gating_activation_reduction": report.get("activation_reduction"), "note": sim.workload_note,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--profile", default=None, help="profile file (default: this machine's, from `edgemoe profile`)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--gating", default="ser", choices=["ser", "score"])
    ap.add_argument("--threshold", type=float, default=0.4)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--save-traces", type=Path, default=None, help="keep each model's trace in this directory")
    args = ap.parse_args()
    prof = load_profile(args.profile or default_profile_path())
    results = []
    print(f"{'model':<34} {'configuration':<24} {'prefill meas':>12} {'proj':>9} {'err':>6}  "
          f"{'decode meas':>11} {'proj':>8} {'err':>6}")
    for path in args.models:
        res = validate(path, args, prof)
        results.append(res)
        for r in res["rows"]:
            print(f"{res['model']:<34} {r['config']:<24} {r['measured_prefill_tps']:>12.1f} "
                  f"{r['projected_prefill_tps']:>9.1f} {r['prefill_error']:>+6.1%}  {r['measured_decode_tps']:>11.2f} "
                  f"{r['projected_decode_tps']:>8.2f} {r['decode_error']:>+6.1%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"profile": prof.name, "profile_notes": prof.notes, "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
