#!/usr/bin/env python3
"""KV cache types and flash attention on the fixtures: held-out NLL per KV type, speed with flash attention on
and off, the size of serve's prompt-cache entries per KV type. Figures in docs/research/benchmarks.md.

  PYTHONPATH=. .venv/bin/python tools/bench_kv_types.py [--threads 2] [--ctx 256] [--reps 3] [--json]

- NLL: `edgemoe perplexity MODEL --input HELDOUT --ctx CTX -ctk T -ctv T --flash-attn on --json` (the command,
  run as a child) on the held-out split (the last 10%) of the two corpora the fixtures were trained on, at f16,
  q8_0 and q4_0 K and V; dNLL against f16.
- Speed: the Engine with flash attention on and off, a --prompt-tokens prompt of the Shakespeare training split
  then --gen greedy tokens (past end-of-generation); prefill tok/s = prompt / time to first token, decode tok/s
  over the steps after the first token; median of --reps runs after a warm-up, the two settings alternating.
- Prompt-cache entries: Engine.snapshot() (what serve's host store keeps) after a --prompt-tokens prompt, bytes
  per KV type.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe import GREEDY, Engine, LoadConfig  # noqa: E402
from edgemoe.calibration.corpus import split_corpus  # noqa: E402

MODELS = sorted((ROOT / "models").glob("*.gguf"))
CORPORA = [ROOT / "edgemoe" / "calibration" / "text" / n for n in ("tinyshakespeare.txt", "python-docs.txt")]
TYPES = ("f16", "q8_0", "q4_0")


def nll(model: Path, text: Path, kind: str, *, ctx: int, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "edgemoe", "perplexity", str(model), "--input", str(text), "--ctx", str(ctx),
           "-t", str(threads), "--flash-attn", "on", "-ctk", kind, "-ctv", kind, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def speed(model: Path, *, threads: int, prompt_tokens: int, gen: int, reps: int) -> dict[str, dict[str, float]]:
    text = split_corpus(CORPORA[0]).train_text()[:20000]
    runs: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    engines = {fa: Engine(model, LoadConfig(n_ctx=1024, n_threads=threads, flash_attn=fa)) for fa in ("on", "off")}
    try:
        prompt = engines["on"].tokenize(text)[:prompt_tokens]
        for eng in engines.values():  # warm-up
            eng.generate(prompt[:16], max_tokens=2, sampling=GREEDY, ignore_eog=True)
        for _ in range(reps):
            for fa, eng in engines.items():
                eng.reset()
                t = eng.generate(prompt, max_tokens=gen, sampling=GREEDY, ignore_eog=True).timings
                runs[fa].append((t.prompt_tps, t.decode_tps))
    finally:
        for eng in engines.values():
            eng.close()
    return {
        fa: {"prefill_tps": statistics.median(r[0] for r in rs), "decode_tps": statistics.median(r[1] for r in rs)}
        for fa, rs in runs.items()
    }


def entry_bytes(model: Path, kind: str, *, threads: int, prompt_tokens: int) -> int:
    text = split_corpus(CORPORA[0]).train_text()[:20000]
    cfg = LoadConfig(n_ctx=1024, n_threads=threads, cache_type_k=kind, cache_type_v=kind)  # type: ignore[arg-type]
    with Engine(model, cfg) as eng:
        eng.eval_logits(eng.tokenize(text)[:prompt_tokens])
        return eng.snapshot().nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256, help="perplexity's tokens per chunk")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res: dict[str, Any] = {"nll": {}, "speed": {}, "entry_bytes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for corpus in CORPORA:
            held = Path(tmp) / corpus.name
            held.write_text(split_corpus(corpus).heldout_text())
            for model in MODELS:
                row = {k: nll(model, held, k, ctx=args.ctx, threads=args.threads) for k in TYPES}
                res["nll"][f"{model.name.split('.')[0]} / {corpus.name}"] = {
                    k: {"nll": r["nll"], "tokens": r["tokens"], "dnll": r["nll"] - row["f16"]["nll"]}
                    for k, r in row.items()
                }
    for model in MODELS:
        name = model.name.split(".")[0]
        res["speed"][name] = speed(
            model, threads=args.threads, prompt_tokens=args.prompt_tokens, gen=args.gen, reps=args.reps
        )
        res["entry_bytes"][name] = {
            k: entry_bytes(model, k, threads=args.threads, prompt_tokens=args.prompt_tokens) for k in TYPES
        }
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print("| fixture / held-out text | tokens | NLL f16 | dNLL q8_0 | dNLL q4_0 |\n|---|---|---|---|---|")
    for key, row in res["nll"].items():
        print(f"| {key} | {row['f16']['tokens']} | {row['f16']['nll']:.4f} | {row['q8_0']['dnll']:+.4f} | "
              f"{row['q4_0']['dnll']:+.4f} |")
    print("\n| fixture | flash attention | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for name, row in res["speed"].items():
        for fa in ("off", "on"):
            print(f"| {name} | {fa} | {row[fa]['prefill_tps']:.0f} | {row[fa]['decode_tps']:.1f} |")
    print(f"\n| fixture | prompt-cache entry, {args.prompt_tokens} tokens: f16 | q8_0 | q4_0 |\n|---|---|---|---|")
    for name, row in res["entry_bytes"].items():
        print(f"| {name} | " + " | ".join(f"{row[k] / 1024:.0f} KiB" for k in TYPES) + " |")


if __name__ == "__main__":
    main()
