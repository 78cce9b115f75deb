#!/usr/bin/env python3
"""KL divergence and same-top rate beside the NLL change, on held-out text, for adaptive top-k, graceful degradation
and the KV cache types (docs/gating.md, docs/research/daop.md, docs/research/benchmarks.md). Pre-calculation:
tools/precalc_eval.py.

  nice -n 10 .venv/bin/python tools/quality_kld.py gating [--max-tokens 4096] [--json docs/figures/quality-gating.json]
  nice -n 10 .venv/bin/python tools/quality_kld.py degrade [--max-tokens 4096] [--json docs/figures/quality-degrade.json]
  nice -n 10 .venv/bin/python tools/quality_kld.py kv [--max-tokens 4096] [--json docs/figures/quality-kv.json]

Both fixtures, the held-out split (last 10%) of both corpora, the first --max-tokens tokens in chunks of 256, each a
fresh sequence; the base is the same model's run without the option (a KL-divergence base of the scored rows,
edgemoe.analysis.kld_base, top 1024 = the whole vocabulary, so the KLD is exact).

- degrade: `edgemoe perplexity --degrade R --expert-slots N`'s computation (analysis.daop.daop_degradation): each
  chunk's first 32 tokens are the prompt DAOP swaps its placement by, the rest is degraded and scored; N = E/4 and
  E/2 slots per MoE layer, R = 0.9, 0.8, 0.6, 0.4.
- kv: `edgemoe perplexity -ctk T -ctv T --flash-attn on` for T = q8_0 and q4_0 against f16 (every row scored).
- gating: `edgemoe perplexity --gating RULE` at the thresholds the bundled calibration's `gating` stage found on
  its validation tokens (train split; calibrations/<model>/thresholds.json): 10%, 25% and 40% fewer activations
  and the default (the KL-divergence budget's), every row scored and gated.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.daop import daop_degradation  # noqa: E402
from edgemoe.analysis.kld import KldComparison  # noqa: E402
from edgemoe.analysis.kld_base import BaseRecorder, KldBase, run_key  # noqa: E402
from edgemoe.analysis.perplexity import perplexity  # noqa: E402
from edgemoe.calibration.card import find_calibration  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402

MODELS = sorted((ROOT / "models").glob("*.gguf"))
CORPORA = ("tinyshakespeare", "python-docs")
CTX, PROMPT, THREADS = 256, 32, 2
RATIOS = (0.9, 0.8, 0.6, 0.4)
KV_TYPES = ("q8_0", "q4_0")


def _tokens(eng: Engine, corpus: str, n: int) -> list[int]:
    text = split_corpus(default_corpus_dir() / f"{corpus}.txt").heldout_text()
    return eng.tokenize(text, add_special=False)[:n]


def _base(eng: Engine, toks: list[int], skip: int) -> tuple[KldBase, float]:
    rec = BaseRecorder(run_key(eng, toks, ctx=CTX, score_from=skip))
    nll = perplexity(eng, toks, ctx=CTX, score_from=skip, rows=rec).nll
    return rec.base(), nll


def _compare(eng: Engine, toks: list[int], skip: int, base: KldBase, base_nll: float,
             policies: list[Any] | None = None) -> dict[str, Any]:
    cmp = KldComparison(base)
    res = perplexity(eng, toks, ctx=CTX, score_from=skip, policies=policies or [], rows=cmp)
    k = cmp.result()
    return {"tokens": res.tokens, "nll": res.nll, "dnll": res.nll - base_nll, "nll_rel": res.nll / base_nll - 1,
            "reduction": res.activation_reduction, "mean_kld": k.mean_kld,
            "kld_99": k.kld_percentiles["99"], "same_top": k.same_top, "rms_dp": k.rms_dp}


def degrade(max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for model in MODELS:
        cal = find_calibration(model).path
        with Engine(model, LoadConfig(n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, n_threads=THREADS)) as eng:
            n_expert = eng.info.n_expert
            for corpus in CORPORA:
                toks = _tokens(eng, corpus, max_tokens)
                base, base_nll = _base(eng, toks, PROMPT)
                for slots in (n_expert // 4, n_expert // 2):
                    for ratio in RATIOS:
                        pols = daop_degradation(eng, cal, slots=slots, ratio=ratio, prompt_tokens=PROMPT)
                        row = {"model": model.stem.split(".")[0], "corpus": corpus, "slots": slots, "ratio": ratio,
                               **_compare(eng, toks, PROMPT, base, base_nll, list(pols)),
                               "cpu_avoided": pols[1].cpu_avoided}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def kv(max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for model in MODELS:
        def engine(kind: str, model: Path = model) -> Engine:
            return Engine(model, LoadConfig(n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, n_threads=THREADS,
                                            flash_attn="on", cache_type_k=kind, cache_type_v=kind))  # type: ignore[arg-type]

        for corpus in CORPORA:
            with engine("f16") as eng:
                toks = _tokens(eng, corpus, max_tokens)
                base, base_nll = _base(eng, toks, 0)
            for kind in KV_TYPES:
                with engine(kind) as eng:
                    row = {"model": model.stem.split(".")[0], "corpus": corpus, "kv": kind,
                           **_compare(eng, toks, 0, base, base_nll)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def gating(max_tokens: int) -> list[dict[str, Any]]:
    from edgemoe.calibration.adaptive import GatingOptions, build_gating, threshold_key

    rows = []
    for model in MODELS:
        cal = find_calibration(model).path
        shipped = json.loads((cal / "thresholds.json").read_text())
        with Engine(model, LoadConfig(n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, n_threads=THREADS)) as eng:
            for corpus in CORPORA:
                toks = _tokens(eng, corpus, max_tokens)
                base, base_nll = _base(eng, toks, 0)
                for rule in ("fisher", "empirical", "score", "ser"):
                    for target in (0.1, 0.25, 0.4, None):
                        opts = GatingOptions(rule, target_reduction=target, calibration=cal, decode_only=False)
                        if threshold_key(opts) not in shipped:  # the stage found none (over the budget at once)
                            continue
                        pol = build_gating(eng, opts)
                        assert pol is not None and pol.calibrated is not None
                        row = {"model": model.stem.split(".")[0], "corpus": corpus, "rule": rule, "target": target,
                               "threshold": pol.threshold, "validation": dict(pol.calibrated),
                               **_compare(eng, toks, 0, base, base_nll, [pol])}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(what: str, rows: list[dict[str, Any]]) -> str:
    if what == "gating":
        out = ["| model | rule | threshold | Shakespeare: NLL / mean KLD / same top (fewer activations) | Python docs |",
               "|---|---|---|---|---|"]
        for (m, rule, target) in dict.fromkeys((r["model"], r["rule"], r["target"]) for r in rows):
            cells = [next(r for r in rows if (r["model"], r["rule"], r["target"], r["corpus"]) == (m, rule, target, c))
                     for c in CORPORA]
            name = f"{target:.0%}" if target is not None else "default (KLD budget)"
            out.append(f"| {m} | {rule} | {name} | " + " | ".join(
                f"{r['nll_rel']:+.2%} / {r['mean_kld']:.4f} / {r['same_top']:.1%} ({r['reduction']:.1%})"
                for r in cells) + " |")
        return "\n".join(out)
    if what == "degrade":
        out = ["| model | corpus | slots | r | NLL | mean KLD | same top | CPU executions avoided |",
               "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['corpus']} | {r['slots']} | {r['ratio']} | {r['nll_rel']:+.2%} | "
                f"{r['mean_kld']:.4f} | {r['same_top']:.1%} | {r['cpu_avoided']:.1%} |" for r in rows]
    else:
        out = ["| model | held-out text | KV type | tokens | dNLL (nats) | NLL | mean KLD | 99% KLD | same top |",
               "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['corpus']} | {r['kv']} | {r['tokens']} | {r['dnll']:+.4f} | "
                f"{r['nll_rel']:+.2%} | {r['mean_kld']:.5f} | {r['kld_99']:.4f} | {r['same_top']:.1%} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["gating", "degrade", "kv"])
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens per corpus (default 4096)")
    ap.add_argument("--json", type=Path, default=None, help="default: docs/figures/quality-<what>.json")
    ap.add_argument("--table", action="store_true", help="print the table of the JSON and stop")
    args = ap.parse_args(argv)
    path = args.json or ROOT / "docs" / "figures" / f"quality-{args.what}.json"
    if args.table:
        print(table(args.what, json.loads(path.read_text())["rows"]))
        return
    t0 = time.monotonic()
    rows = {"gating": gating, "degrade": degrade, "kv": kv}[args.what](args.max_tokens)
    doc = {"ctx": CTX, "prompt_tokens": PROMPT if args.what == "degrade" else 0, "max_tokens": args.max_tokens,
           "n_threads": THREADS, "rows": rows, "seconds": round(time.monotonic() - t0, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(args.what, rows))


if __name__ == "__main__":
    main()
