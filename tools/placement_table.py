#!/usr/bin/env python3
"""Equal vs DP cache allocation, and DALI vs LRU replacement, replayed on held-out traces.

  PYTHONPATH=. .venv/bin/python tools/placement_table.py TRACE.npz [TRACE.npz ...] [--json out.json]

Each TRACE is `edgemoe trace MODEL --input CORPUS --heldout --mode decode ...` (docs/research/placement.md has
the commands); traces of the same model are grouped. The DP allocation comes from the model's
calibration (its routing_trace.npz: the train splits), never from the held-out text; static's
frequencies too. Every number is a replay of the policy (edgemoe.policies.residency, the code the
engine runs) over all MoE layers: a layer given no slots computes all of its routed experts on the
CPU, so its routed slots count as misses. Decode tokens are counted; prefills are replayed (they change
what is resident) but not counted. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.trace import Trace  # noqa: E402
from edgemoe.calibration.card import find_calibration  # noqa: E402
from edgemoe.calibration.slot_alloc import RoutingTrace, allocate_slots  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.policies.allocation import Curve, decode_steps, equal_allocate, layer_steps, replay_curve  # noqa: E402
from edgemoe.policies.residency import dali_default_update, load_frequency  # noqa: E402

POLICIES = ("lru", "dali", "static")
Steps = tuple[dict[int, list[np.ndarray]], np.ndarray]  # per-layer steps, which of them are decode tokens


def curves_of(steps: Steps, policy: str, n_expert: int, freq: dict[int, np.ndarray],
              **kw: Any) -> dict[int, Curve]:
    """Every layer replayed for every slot count; decode tokens counted, prefills replayed only."""
    by_layer, decode = steps
    return {il: replay_curve(s, policy, n_expert, n_expert=n_expert, frequency=freq.get(il), counted=decode,
                             **kw) for il, s in by_layer.items()}


def score(curves: dict[int, Curve], slots: dict[int, int]) -> dict[str, float]:
    """Hit rate over every routed expert slot, misses and loads per token, of an allocation."""
    routed = sum(c.routed for c in curves.values())
    tokens = next(iter(curves.values())).tokens
    misses = sum(int(curves[il].misses[t]) for il, t in slots.items())
    loads = sum(int(curves[il].loads[t]) for il, t in slots.items())
    return {"hit_rate": 1.0 - misses / routed, "misses_per_token": misses / tokens,
            "loads_per_token": loads / tokens}


def model_tables(model: Path, traces: list[tuple[str, Steps]]) -> dict[str, Any]:
    info = read_model_info(model)
    E, layers = info.n_expert, list(info.moe_layers)
    cal = find_calibration(model)
    routing = RoutingTrace.load(cal.path, info=info)
    train = (routing.steps(), decode_steps(routing.phase, routing.seq, ubatch=routing.ubatch))
    freq = load_frequency(cal.path, n_expert=E, layers=layers)
    evals = [("calibration (train)", train)] + traces
    out: dict[str, Any] = {"model": model.name, "calibration": str(cal.path), "n_expert": E,
                           "layers": len(layers), "alloc": [], "dali": []}
    replays = {(name, pol): curves_of(steps, pol, E, freq) for name, steps in evals for pol in POLICIES}
    for per_layer in (E // 4, E // 2):
        total = per_layer * len(layers)
        for pol in POLICIES:  # what `--alloc dp --expert-slots N --policy pol` runs
            dp = allocate_slots(info, alloc="dp", policy=pol, calibration=cal.path,
                                 slots_per_layer=per_layer).slots
            for alloc, slots in (("equal", equal_allocate(layers, total, max_slots=E)), ("dp", dp)):
                row = {"slots": per_layer, "policy": pol, "alloc": alloc,
                       "per_layer": [slots[il] for il in layers]}
                row["on"] = {name: score(replays[(name, pol)], slots) for name, _ in evals}
                out["alloc"].append(row)
    # DALI's window / update against LRU, equal allocation, on the held-out traces
    per_layer = E // 4
    slots = {il: per_layer for il in layers}
    updates = sorted({1, dali_default_update(E), max(1, E // 4)})
    variants = [("lru", {})] + [("dali", {"window": w, "update": u})
                                for w in (1, 2, 4, 8, 16) for u in updates]
    for pol, kw in variants:
        row = {"policy": pol, **kw, "on": {}}
        for name, steps in traces:
            curves = curves_of(steps, pol, E, freq, **kw) if kw else replays[(name, pol)]
            row["on"][name] = score(curves, slots)
        out["dali"].append(row)
    return out


def markdown(res: dict[str, Any]) -> str:
    names = list(res["alloc"][0]["on"])
    lines = [f"### {res['model']} ({res['n_expert']} experts, {res['layers']} MoE layers)", "",
             "hit rate / misses per token / loads per token (decode tokens); `slots` is the average per "
             "MoE layer", "",
             "| slots | policy | alloc | slots per layer | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in res["alloc"]:
        cells = [f"{s['hit_rate']:.3f} / {s['misses_per_token']:.2f} / {s['loads_per_token']:.2f}"
                 for s in r["on"].values()]
        per_layer = " ".join(map(str, r["per_layer"]))
        lines.append(f"| {r['slots']} | {r['policy']} | {r['alloc']} | {per_layer} | "
                     + " | ".join(cells) + " |")
    held = [n for n in names if n != "calibration (train)"]
    lines += ["", (f"DALI window w / update u vs LRU, {res['n_expert'] // 4} slots in every MoE layer, "
                   "held-out (hit rate / loads per token)"), "",
              "| policy | w | u | " + " | ".join(held) + " |", "|---|---|---|" + "---|" * len(held)]
    for r in res["dali"]:
        cells = [f"{r['on'][n]['hit_rate']:.3f} / {r['on'][n]['loads_per_token']:.2f}" for n in held]
        lines.append(f"| {r['policy']} | {r.get('window', '')} | {r.get('update', '')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path,
                    help="held-out traces (edgemoe trace --heldout --mode decode)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON")
    args = ap.parse_args()
    by_model: dict[Path, list[tuple[str, Steps]]] = {}
    for path in args.traces:
        tr = Trace.load(path)
        if not tr.meta.get("heldout"):
            print(f"warning: {path} was not recorded with --heldout", file=sys.stderr)
        name = Path(str(tr.meta.get("input", path.stem))).stem + " (held-out)"
        ubatch = int(tr.meta.get("n_batch", 512))
        steps = (layer_steps(tr.ids, list(tr.layers), tr.phase, tr.seq, ubatch=ubatch),
                 decode_steps(tr.phase, tr.seq, ubatch=ubatch))
        by_model.setdefault(Path(str(tr.meta["model"])).resolve(), []).append((name, steps))
    results = [model_tables(model, traces) for model, traces in by_model.items()]
    print("\n\n".join(markdown(r) for r in results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
