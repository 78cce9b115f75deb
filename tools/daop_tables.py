#!/usr/bin/env python3
"""Markdown tables of docs/research/daop.md from tools/daop_eval.py's JSON files.

  .venv/bin/python tools/daop_tables.py --placement P.json --precalc C.json --quality Q.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def placement(res: list[dict[str, Any]]) -> str:
    out = []
    for m in res:
        traces = list(dict.fromkeys(r["trace"] for r in m["rows"]))
        cells: dict[tuple[int, str, str], dict[str, str]] = defaultdict(dict)
        for r in m["rows"]:
            cells[(r["slots"], r["policy"], r["alloc"])][r["trace"]] = (
                f"{r['hit_rate']:.3f} / {r['cpu_per_token']:.2f} / {r['loads_per_token']:.2f}")
        out += [f"#### {m['model']} ({m['n_expert']} experts)", "",
                "hit rate / CPU expert executions per token / expert copies per token (decode tokens)", "",
                _table(["slots", "policy", "alloc", *traces],
                       [[str(s), p, a, *(c[t] for t in traces)] for (s, p, a), c in cells.items()]), ""]
        proj: dict[tuple[int, str], dict[str, str]] = defaultdict(dict)
        for r in m["projected"]:
            key = (r["slots"], r["policy"])
            prev = proj[key].get(r["trace"], "")
            tps = f"{r['decode_tps']:.1f}"
            proj[key][r["trace"]] = (f"{prev} / {tps}" if prev else tps) + (
                f" ({r['pcie_mb_per_token']:.0f} MB)" if r["overlap"] else "")
        shape = m["projected"][0]["shape"] if m["projected"] else "?"
        out += [f"Projected decode tokens/s, {shape}, profile {m['projected'][0]['profile']}: CPU and GPU "
                "branches one after the other / at once (copied MB per token)", "",
                _table(["slots", "policy", *traces], [[str(s), p, *(c[t] for t in traces)]
                                                       for (s, p), c in proj.items()]), ""]
    return "\n".join(out)


def _agg(per_layer: list[dict[str, float]], first: int) -> dict[str, float]:
    rows = [r for i, r in enumerate(per_layer) if i + 1 >= first]
    cpu = sum(r["cpu_per_token"] for r in rows)
    pred = sum(r["predicted_cpu_per_token"] for r in rows)
    hit = sum(r["recall"] * r["cpu_per_token"] for r in rows)
    return {"topk": sum(r["topk_recall"] for r in rows) / len(rows), "precision": hit / pred if pred else 0.0,
            "recall": hit / cpu if cpu else 0.0, "cpu": cpu, "wasted": sum(r["wasted_per_token"] for r in rows)}


def precalc(res: list[dict[str, Any]]) -> str:
    out = ["Gate-reuse pre-calculation of DAOP's CPU experts, decode tokens (targets: MoE layers pre-calculated)", "",
           ]
    rows = []
    for m in res:
        for a in m["accuracy"]:
            for first in (1, 5):
                g = _agg(a["per_layer"], first)
                rows.append([m["model"].split(".")[0], str(a["slots"]), a["trace"], f"{first}-7",
                             f"{g['topk']:.3f}", f"{g['precision']:.3f}", f"{g['recall']:.3f}",
                             f"{g['cpu']:.2f}", f"{g['wasted']:.2f}"])
    out += [_table(["model", "slots", "trace", "targets", "top-k recall", "precision", "recall (CPU work early)",
                    "CPU experts / token", "wasted pre-calcs / token"], rows), ""]
    rows = []
    for m in res:
        by_layer: dict[int, list[dict[str, float]]] = defaultdict(list)
        for e in m["layer_error"]:
            for r in e["per_layer"]:
                by_layer[r["layer"]].append(r)
        for il, rs in sorted(by_layer.items()):
            mean = {k: sum(r[k] for r in rs) / len(rs) for k in rs[0] if k != "layer"}
            rows.append([m["model"].split(".")[0], str(il), f"{mean['precalc_per_token']:.2f}",
                         f"{mean['expert_rel_err']:.3f}", f"{mean['rel_err']:.3f}", f"{mean['rel_err_renorm']:.3f}",
                         f"{mean['rel_err_skip']:.3f}"])
    out += ["Relative error of the MoE layer output, numpy reference, mean over the held-out traces (E/4 slots)", "",
            _table(["model", "layer", "pre-calculated / token", "expert output err", "layer err (x_l)",
                    "layer err (renormalised)", "layer err if skipped"], rows)]
    return "\n".join(out)


def quality(rows: list[dict[str, Any]]) -> str:
    deg = [[r["model"].split(".")[0], r["corpus"], str(r["slots"]), f"{r['ratio']:g}", f"{100 * r['nll_rel']:+.2f}%",
            f"{r['agreement']:.3f}", f"{r['cpu_per_token']:.2f}", f"{100 * (r['cpu_avoided'] or 0):.1f}%"]
           for r in rows if r["kind"] == "degrade"]
    pre = [[r["model"].split(".")[0], r["corpus"], str(r["slots"]),
            "none" if r["first_target"] is None else f"{r['first_target']}-7",
            "-" if r["first_target"] is None else ("renormalised" if r["renorm"] else "x_l"),
            f"{100 * r['nll_rel']:+.2f}%", f"{r['agreement']:.3f}",
            "-" if r["precalc_share"] is None else f"{100 * r['precalc_share']:.1f}%"]
           for r in rows if r["kind"] == "precalc"]
    base = {(r["model"].split(".")[0], r["corpus"]): r["base_agreement"] for r in rows}
    return "\n".join([
        "Graceful degradation (llama.cpp): NLL change and greedy agreement with stock, CPU expert executions", "",
        _table(["model", "corpus", "slots", "r", "NLL", "greedy agreement", "CPU experts / token (before)",
                "CPU executions avoided"], deg), "",
        "no-degradation agreement (the teacher-forced check against stock's own generation): "
        + ", ".join(f"{m} {c} {a:.3f}" for (m, c), a in base.items()), "",
        "Pre-calculation (torch reference): NLL change against the reference without it, greedy agreement with "
        "stock, share of CPU expert executions pre-calculated", "",
        _table(["model", "corpus", "slots", "targets", "input", "NLL", "greedy agreement", "pre-calculated"], pre)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--placement", type=Path)
    ap.add_argument("--precalc", type=Path)
    ap.add_argument("--quality", type=Path)
    args = ap.parse_args()
    for path, fn in ((args.placement, placement), (args.precalc, precalc), (args.quality, quality)):
        if path is not None:
            print(fn(json.loads(path.read_text())), "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
