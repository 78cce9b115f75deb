#!/usr/bin/env python3
"""Decode speed of two builds of the native library (and the edgemoe trees that go with them), alternating runs.

  .venv/bin/python tools/bench_library_ab.py MODEL --a NAME:TREE:LIBDIR --b NAME:TREE:LIBDIR [--reps 5]
      [--gen 32] [--slots 32] [--policy lru] [--threads 2] [--json FILE]

Each side runs `edgemoe generate MODEL ... --json` in a process of its own, with PYTHONPATH=TREE (the edgemoe
source that matches the library's patch level) and LLAMA_CPP_LIB_PATH=LIBDIR (a copy of llama_cpp/lib of that
build). The runs alternate a, b, a, b, ... so that a machine whose load drifts meets both sides alike; the medians
of decode tokens/s and their ratio b/a are printed, with every run. For a change that must cost nothing (the
native contract's refactor): a ratio within the runs' spread is noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


@dataclass(frozen=True)
class Side:
    name: str
    tree: Path
    libdir: Path

    @classmethod
    def parse(cls, text: str) -> Side:
        name, tree, libdir = text.split(":", 2)
        return cls(name, Path(tree).resolve(), Path(libdir).resolve())


def run_once(side: Side, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "edgemoe.cli", "generate", str(args.model), "-p", PROMPT, "-n", str(args.gen),
           "--temp", "0", "-t", str(args.threads), "--expert-slots", str(args.slots), "--policy", args.policy,
           "--alloc", "equal", "--json"]
    env = {**os.environ, "PYTHONPATH": str(side.tree), "LLAMA_CPP_LIB_PATH": str(side.libdir)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=side.tree, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{side.name}: edgemoe generate failed:\n{proc.stderr[-2000:]}")
    t = json.loads(proc.stdout.strip().splitlines()[-1])["timings"]
    return {"decode_tps": float(t["decode_tps"]), "prompt_tps": float(t["prompt_tps"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--a", required=True, type=Side.parse, help="NAME:TREE:LIBDIR of the first side (the baseline)")
    ap.add_argument("--b", required=True, type=Side.parse, help="NAME:TREE:LIBDIR of the second side")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32, help="expert slots per MoE layer (the CPU stand-in cache)")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    runs: dict[str, list[dict[str, float]]] = {args.a.name: [], args.b.name: []}
    for rep in range(args.reps):
        for side in (args.a, args.b):
            r = run_once(side, args)
            runs[side.name].append(r)
            print(f"rep {rep + 1} {side.name:>8}: decode {r['decode_tps']:7.2f} tok/s", flush=True)
    med = {name: statistics.median(r["decode_tps"] for r in rs) for name, rs in runs.items()}
    ratio = med[args.b.name] / med[args.a.name]
    spread = {name: (min(r["decode_tps"] for r in rs), max(r["decode_tps"] for r in rs)) for name, rs in runs.items()}
    for name in runs:
        lo, hi = spread[name]
        print(f"{name:>8}: median decode {med[name]:.2f} tok/s (runs {lo:.2f}-{hi:.2f})")
    print(f"{args.b.name} / {args.a.name}: {ratio:.3f}")
    if args.json:
        out = {"model": str(args.model), "sides": [asdict(args.a), asdict(args.b)], "runs": runs, "median": med,
               "ratio": ratio, "load_avg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
