#!/usr/bin/env python3
"""Decode and prefill speed of edgemoe's Engine vs stock llama-cpp-python, same GGUF, same threads, one run.

  .venv/bin/python tools/bench_generate.py MODEL... [--gen 64] [--reps 3] [--threads 2] [--prompt-tokens N]
      [--hooks] [--gating MODE --threshold T | --target-reduction R] [--ideal-k K] [--json]

Both sides generate greedily past end-of-generation tokens from the same prompt
(the short PROMPT below, or --prompt-tokens tokens of the Shakespeare corpus's
training part); decode tokens/s counts the steps after the first token (the first
comes out of prefill), as llama.cpp does; prefill tokens/s is prompt tokens over
the time to the first token on both sides. After each load both sides first
generate --warmup tokens (page faults of the first pass over the weights), then
forget them and run the timed generation. Runs alternate (stock, then each
edgemoe variant, then each extra stock variant) and the median of --reps is
reported with the ratio to stock.

Variants: `edgemoe` (no hook); --hooks adds a no-op Python MoE hook and the trace
recorder (ids, weights and router inputs copied every layer); --gating MODE with
--threshold T or --target-reduction R adds adaptive top-k on decode tokens inside
the graph (`gate`, Engine.set_gating) and through the Python hook (`gate_hook`),
with the measured share of decode expert activations dropped; --ideal-k K adds
stock with K experts per token instead of the model's k (llama.cpp's
--override-kv), the ideal a gating rule that drops the same share would reach.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402

from edgemoe import GREEDY, Engine, LoadConfig  # noqa: E402
from edgemoe.analysis.perplexity import ActivationCounter  # noqa: E402
from edgemoe.analysis.trace import TraceRecorder  # noqa: E402
from edgemoe.analysis.verify import FnPolicy  # noqa: E402
from edgemoe.calibration.adaptive import MODES, GatingOptions, build_gating  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.placement import gating_for  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
REDUCTION: dict[str, float | None] = {}  # variant -> decode activation reduction of its last run


def load_stock(path: Path, threads: int, n_ctx: int, k: int | None = None, repack: bool = True) -> Any:
    """llama-cpp-python's Llama; k overrides the experts per token, repack=False turns CPU repacking off."""
    kv = {f"{read_model_info(path).architecture}.expert_used_count": k} if k else None
    defaults = llama_cpp.llama_cpp.llama_model_default_params
    if not repack:  # Llama() has no option for it: its model params come from this function
        def no_repack() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params
        llama_cpp.llama_cpp.llama_model_default_params = no_repack
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               kv_overrides=kv, verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults


def stock_once(llm: Any, prompt: list[int], n_gen: int, warmup: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation, after `warmup` tokens generated and dropped."""
    if warmup:  # the first pass over the weights after a load pays for page faults
        gen = llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)
        for _ in range(warmup):
            next(gen)
        gen.close()
    llm.reset()
    t0 = time.perf_counter()
    gen = llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)
    next(gen)  # prefill + first token
    t1 = time.perf_counter()
    for _ in range(n_gen - 1):
        next(gen)
    t2 = time.perf_counter()
    gen.close()
    return len(prompt) / (t1 - t0), (n_gen - 1) / (t2 - t1)


def configure(eng: Engine, path: Path, variant: str, gating: GatingOptions | None) -> ActivationCounter | None:
    """Set the engine up for one variant (gating, hooks); returns the hook path's activation counter."""
    eng.set_gating(None)
    eng.set_policies(None)
    if variant in ("gate", "gate_hook") and gating is not None:
        opts = gating_for(gating, path)
        policy = build_gating(eng, opts)
        if variant == "gate":
            assert eng.set_gating(policy) == "graph"
        else:
            counter = ActivationCounter(decode_only=True)
            eng.set_policies([policy, counter])
            return counter
    elif variant == "noop":
        eng.set_policies([FnPolicy(lambda r: None)])
    elif variant == "trace":
        eng.set_policies([TraceRecorder(gate_inputs=True)])
    return None


def edgemoe_once(eng: Engine, prompt: list[int], n_gen: int, warmup: int, variant: str,
                 counter: ActivationCounter | None) -> tuple[float, float]:
    if warmup:  # page faults after a load, the graph rebuilt after a change of variant
        eng.generate(prompt, max_tokens=warmup, sampling=GREEDY, ignore_eog=True)
    eng.reset()
    eng.reset_control_stats()
    if counter is not None:
        counter.kept = counter.full = 0
    g = eng.generate(prompt, max_tokens=n_gen, sampling=GREEDY, ignore_eog=True)
    if variant == "gate":
        REDUCTION[variant] = eng.gating_report()["activation_reduction"]
    elif counter is not None:
        REDUCTION[variant] = 1 - counter.kept / counter.full if counter.full else None
    return len(prompt) / g.timings.ttft_s, g.timings.decode_tps


def stock_run(path: Path, prompt: list[int], n_gen: int, threads: int, n_ctx: int, warmup: int,
              k: int | None = None) -> tuple[float, float]:
    llm = load_stock(path, threads, n_ctx, k)
    try:
        return stock_once(llm, prompt, n_gen, warmup)
    finally:
        llm.close()


def edgemoe_run(path: Path, prompt: list[int], n_gen: int, threads: int, n_ctx: int, warmup: int, variant: str,
                gating: GatingOptions | None) -> tuple[float, float]:
    with Engine(path, LoadConfig(n_ctx=n_ctx, n_threads=threads)) as eng:
        return edgemoe_once(eng, prompt, n_gen, warmup, variant, configure(eng, path, variant, gating))


def same_process_runs(path: Path, prompt: list[int], args: argparse.Namespace, n_ctx: int, variants: list[str],
                      gating: GatingOptions | None, ideal: str | None) -> dict[str, list[tuple[float, float]]]:
    """Every configuration loaded once, side by side, repacking off so that they all compute from the
    same mmap'd weights (no copies, one page cache); runs alternate."""
    stock = load_stock(path, args.threads, n_ctx, repack=False)
    low = load_stock(path, args.threads, n_ctx, k=args.ideal_k, repack=False) if ideal else None
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in ["stock", *variants, *([ideal] if ideal else [])]}
    with Engine(path, LoadConfig(n_ctx=n_ctx, n_threads=args.threads, use_extra_bufts=False)) as eng:
        for _ in range(args.reps):
            runs["stock"].append(stock_once(stock, prompt, args.gen, args.warmup))
            for v in variants:
                counter = configure(eng, path, v, gating)
                runs[v].append(edgemoe_once(eng, prompt, args.gen, args.warmup, v, counter))
            if ideal:
                runs[ideal].append(stock_once(low, prompt, args.gen, args.warmup))
    stock.close()
    if low is not None:
        low.close()
    return runs


def make_prompt(path: Path, n_tokens: int | None) -> list[int]:
    """The prompt's ids (llama.cpp's tokenizer, BOS as the model says: the same on both sides)."""
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    text = PROMPT if n_tokens is None else split_corpus(
        default_corpus_dir() / "tinyshakespeare.txt").train_text()[:20 * n_tokens]
    ids = vocab.tokenize(text.encode(), add_bos=True)
    vocab.close()
    return ids if n_tokens is None else ids[:n_tokens]


def bench_model(path: Path, args: argparse.Namespace, variants: list[str],
                gating: GatingOptions | None) -> dict[str, Any]:
    prompt = make_prompt(path, args.prompt_tokens)
    n_ctx = max(args.ctx, len(prompt) + args.gen + 8)
    ideal = f"stock_k{args.ideal_k}" if args.ideal_k else None
    if args.same_process:
        runs = same_process_runs(path, prompt, args, n_ctx, variants, gating, ideal)
    else:
        runs = {v: [] for v in ["stock", *variants, *([ideal] if ideal else [])]}
        for _ in range(args.reps):
            runs["stock"].append(stock_run(path, prompt, args.gen, args.threads, n_ctx, args.warmup))
            for v in variants:
                runs[v].append(edgemoe_run(path, prompt, args.gen, args.threads, n_ctx, args.warmup, v, gating))
            if ideal:
                runs[ideal].append(stock_run(path, prompt, args.gen, args.threads, n_ctx, args.warmup,
                                             k=args.ideal_k))
    med = {v: (statistics.median(p for p, _ in r), statistics.median(d for _, d in r)) for v, r in runs.items()}
    row: dict[str, Any] = {"model": path.name, "threads": args.threads, "gen_tokens": args.gen,
                           "prompt_tokens": len(prompt), "reps": args.reps,
                           "mode": "same process, repacking off" if args.same_process else "a load per run",
                           "decode_tps_runs": {v: [round(d, 2) for _, d in r] for v, r in runs.items()}}
    for v, (p, d) in med.items():
        key = "stock" if v == "stock" else (v if v.startswith("stock") else f"edgemoe_{v}".replace("_none", ""))
        row[f"{key}_decode_tps"] = round(d, 2)
        row[f"{key}_prefill_tps"] = round(p, 2)
        if v != "stock":
            row[f"{key}_decode_ratio"] = round(d / med["stock"][1], 3)
            row[f"{key}_prefill_ratio"] = round(p / med["stock"][0], 3)
    if gating is not None:
        row["gating"] = {"mode": gating.mode, "threshold": gating.threshold,
                         "target_reduction": gating.target_reduction}
        for v in ("gate", "gate_hook"):
            if v in REDUCTION:
                row[f"edgemoe_{v}_decode_activation_reduction"] = round(REDUCTION[v], 3)
    if ideal and "gate" in variants and REDUCTION.get("gate"):
        # the ideal speed-up at the gate's reduction, by linear interpolation in the share of experts dropped
        k = read_model_info(path).n_expert_used
        ideal_gain = (row[f"{ideal}_decode_ratio"] - 1) * REDUCTION["gate"] / (1 - args.ideal_k / k)
        row["ideal_decode_ratio_at_gate_reduction"] = round(1 + ideal_gain, 3)
        row["gate_share_of_ideal_speedup"] = round((row["edgemoe_gate_decode_ratio"] - 1) / ideal_gain, 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=16,
                    help="tokens generated (and discarded) after each load before the timed run")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt of N corpus tokens (prefill speed); default: a short fixed prompt")
    ap.add_argument("--hooks", action="store_true", help="also time a no-op hook and the trace recorder")
    ap.add_argument("--gating", choices=[m for m in MODES if m != "off"], default=None,
                    help="also time adaptive top-k with this rule on decode tokens, in the graph and through "
                         "the Python hook; needs --threshold or --target-reduction (the latter and "
                         "fisher/empirical need the model's calibration)")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--target-reduction", type=float, default=None)
    ap.add_argument("--ideal-k", type=int, default=None,
                    help="also time stock with K experts per token (the ideal of adaptive top-k)")
    ap.add_argument("--same-process", action="store_true",
                    help="load every configuration once, side by side, with CPU repacking off (all compute from "
                         "the same mmap'd weights) and alternate the runs: removes the run-to-run spread of "
                         "reloading a model larger than half the RAM")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = ["none"] + (["noop", "trace"] if args.hooks else []) + (["gate", "gate_hook"] if args.gating else [])
    gating = (GatingOptions(args.gating, threshold=args.threshold, target_reduction=args.target_reduction)
              if args.gating else None)
    rows = [bench_model(path, args, variants, gating) for path in args.models]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['model']}: {r['prompt_tokens']} prompt tokens, {r['gen_tokens']} generated, "
              f"{r['threads']} threads, median of {r['reps']}")
        print(f"  {'configuration':<24} {'decode tok/s':>12} {'ratio':>7} {'prefill tok/s':>14} {'ratio':>7}")
        for key in [k[:-len("_decode_tps")] for k in r if k.endswith("_decode_tps")]:
            ratio = r.get(f"{key}_decode_ratio", 1.0)
            pratio = r.get(f"{key}_prefill_ratio", 1.0)
            print(f"  {key:<24} {r[key + '_decode_tps']:>12.2f} {ratio:>7.3f} {r[key + '_prefill_tps']:>14.1f} "
                  f"{pratio:>7.3f}")
        for key, val in r.items():
            if "reduction" in key or "ideal_decode" in key or "share_of_ideal" in key:
                print(f"  {key}: {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
