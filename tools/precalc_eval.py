#!/usr/bin/env python3
"""DAOP's pre-calculation run inside llama.cpp on held-out text: its NLL cost and the share of the
CPU's expert executions it starts one layer early, for both fixtures (docs/research/daop.md, "Pre-calculation (§IV-C)").

  nice -n 10 .venv/bin/python tools/precalc_eval.py [--max-tokens 4096] [--json docs/figures/daop-precalc-run.json]
  nice -n 10 .venv/bin/python tools/precalc_eval.py --max-tokens 300 --json /tmp/precalc-smoke.json  # smoke run

Per fixture and slots, one engine (ctx 256, n_threads 2) with the static expert cache over the calibration's
placement (`edgemoe perplexity --precalc-from`'s: equal slots per MoE layer, never swapped); per corpus and first
target layer, edgemoe.analysis.precalc_run.precalc_run over the first --max-tokens held-out tokens (the last 10%
of the corpus, edgemoe.calibration.corpus.split_corpus; written to $TMPDIR/edgemoe-precalc/heldout-<corpus>.txt): every
256-token chunk twice, its first 32 tokens as one ubatch, the rest one token per ubatch, without and with the
pre-calculation. Targets 1-7 pre-calculate every MoE layer that has one before it, 5-7 the paper's late layers.

The quality columns compare each run with the same run without the pre-calculation: NLL change, mean KL
divergence of the next-token distributions (whole vocabulary) and top-1 agreement (llama.cpp's "same top p").
precalc_run's counters: early_share = used / (used + late), the CPU expert executions *of the target layers*
that ran early, and early_share_all = used / cpu_decode, the share of every MoE layer's decode CPU executions
(the cache's misses in the single-token ubatches), the torch reference's "pre-calculated" column. Prints a
markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.precalc_run import precalc_run  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402
from edgemoe.placement import enable_static_placement  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402

MODELS = (("edgemoe-tiny-mixtral.Q4_K_M.gguf", (2, 4)), ("edgemoe-tiny-qwen3moe.Q4_K_M.gguf", (8, 16)))
CORPORA = ("tinyshakespeare", "python-docs")
FIRST_LAYERS = (1, 5)
CTX, PROMPT, THREADS = 256, 32, 2
WORK = Path(tempfile.gettempdir()) / "edgemoe-precalc"  # the held-out texts (.build is a shared, read-only tree)

def heldout(corpus: str) -> Path:
    out = WORK / f"heldout-{corpus}.txt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(split_corpus(default_corpus_dir() / f"{corpus}.txt").heldout_text(), encoding="utf-8")
    return out


def run_model(model: Path, slots: int, max_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Engine(model, LoadConfig(n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, n_threads=THREADS)) as eng:
        enable_static_placement(eng, model, slots, None)
        for corpus in CORPORA:
            text = heldout(corpus).read_text(encoding="utf-8", errors="replace")
            tokens = eng.tokenize(text, add_special=False)[:max_tokens]
            for first in FIRST_LAYERS:
                t0 = time.monotonic()
                run = precalc_run(eng, tokens, ctx=CTX, prompt_tokens=PROMPT, first_layer=first)
                st = run.stats
                row = {"model": model.stem.split(".")[0], "corpus": corpus, "slots": slots, "first_layer": first,
                       "targets": f"{first}-{eng.info.n_layer - 1}", **run.to_dict(),
                       "wasted_per_token": (st["computed"] - st["used"]) / max(run.tokens, 1),
                       "seconds": round(time.monotonic() - t0, 1)}
                rows.append(row)
                print(f"[{row['model']} slots {slots} {corpus} from {first}] {run.tokens} tokens, NLL change "
                      f"{run.nll_change:+.2%}, top-1 {run.top1_agreement:.3f}, early {st['early_share']:.3f}, "
                      f"{row['seconds']:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The docs/research/daop.md table."""
    out = ["| model | corpus | slots | targets | NLL change | mean KLD | top-1 agreement (same top) | CPU executions "
           "early: target layers / all layers | precision | wasted pre-calcs / token |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stats"]
        out.append(f"| {r['model']} | {r['corpus']} | {r['slots']} | {r['targets']} | {r['nll_change']:+.2%} | "
                   f"{r['mean_kld']:.4f} | {r['top1_agreement']:.3f} | {st['early_share']:.1%} / {st['early_share_all']:.1%} | "
                   f"{st['precision']:.3f} | {r['wasted_per_token']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens per corpus (default 4096)")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "figures" / "daop-precalc-run.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for name, slot_list in MODELS:
        for slots in slot_list:
            rows += run_model(ROOT / "models" / name, slots, args.max_tokens)
    doc = {"ctx": CTX, "prompt_tokens": PROMPT, "max_tokens": args.max_tokens, "n_threads": THREADS,
           "placement": "static, the calibration's (equal slots per MoE layer)", "rows": rows,
           "seconds": round(time.monotonic() - t0, 1)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
