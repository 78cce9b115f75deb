#!/usr/bin/env python3
"""The policy `--vram` chooses, re-derived from projections on realistic routing.

For each bundled routing profile of a real model whose shape has a synthetic-model preset, a shape-only GGUF
(edgemoe.gguf.synth, header only) and a trace drawn from the profile (edgemoe.analysis.routing_profile: 4
prompts of 256 prefill + 256 decode tokens, seed 0), `edgemoe simulate` projects every residency policy at
8 GiB on each bundled machine profile, the CPU/GPU overlap on (what the build runs with a cache on a GPU).
OLMoE-1B-7B fits whole in 8 GiB (it then runs as stock -ngl 999, without a cache), so it is also projected at
3 GiB. static and daop are placed by the trace's first prompt and every configuration replays the others
(simulate's rule without a calibration), so their placement meets prompts it was not fitted on, as in use.
lru with `--assign` is not a column: the simulator applies the assigner to prefill ubatches only, so its
decode is lru's (the runtime's per-miss cpu-or-wait choice in decode is not modelled).

    PYTHONPATH=. .venv/bin/python tools/default_policy.py [--json docs/figures/default-policy.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.analysis.routing_profile import routing_for_model  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.gguf.synth import write_synthetic  # noqa: E402
from edgemoe.perf.model.profile import load_profile  # noqa: E402
from edgemoe.perf.model.simulate import SimSpec, simulate  # noqa: E402
from edgemoe.plan.budget import slot_budget  # noqa: E402
from edgemoe.plan.reserve import VRAM_RESERVE  # noqa: E402

# profiles with a preset of the same name, and the budgets (GiB) to project them at
SHAPES = {"qwen3-30b-a3b": (8,), "mixtral-8x7b": (8,), "olmoe-1b-7b": (8, 3)}
MACHINES = ("rtx4060-laptop", "rtx4090-desktop")
POLICIES = ("lru", "static", "dali", "daop")
COLUMNS = ("edgemoe-lru", "edgemoe-static", "edgemoe-dali", "edgemoe-daop")


def _model(shape: str) -> Path:
    path = Path(".build/shapes") / f"{shape}.Q4_K.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(shape, path, shape_only=True, progress=False)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print("PROJECTED decode tok/s (x the best stock configuration; hit rate of the decode tokens)\n")
    print("| routing | machine | VRAM | best stock | " + " | ".join(c.removeprefix("edgemoe-") for c in COLUMNS) + " |")
    print("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |")
    ratios: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for shape, budgets in SHAPES.items():
        model = _model(shape)
        info = read_model_info(model)
        drawn = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers), name=shape)
        for gib, machine in [(g, m) for g in budgets for m in MACHINES]:
            whole = slot_budget(info, gib * 2**30, n_ctx=4096, reserve_bytes=VRAM_RESERVE).all_experts_fit
            res = simulate(model, drawn.trace, load_profile(machine),
                           SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True, policies=POLICIES))
            by = {c.name: c for c in res.configs}
            stock = max((c for c in res.configs if c.kind == "stock"), key=lambda c: c.decode_tps)
            cells = []
            for name in COLUMNS:
                c = by[name]
                if not whole:
                    ratios[name].append(c.decode_tps / stock.decode_tps)
                cells.append(f"{c.decode_tps:.1f} ({c.decode_tps / stock.decode_tps:.2f}x, {c.decode_hit_rate:.2f})")
            label = " (whole model fits: runs as stock, no cache)" if whole else ""
            print(f"| {shape} | {machine} | {gib} GiB{label} | {stock.decode_tps:.1f} ({stock.name}) | "
                  + " | ".join(cells) + " |")
            rows += [{"routing": shape, "machine": machine, "vram_gib": gib, "whole_model_fits": whole, **c.__dict__}
                     for c in res.configs]
    print("\ngeometric mean x best stock over the rows with a cache: " + ", ".join(
        f"{c.removeprefix('edgemoe-')} {math.exp(sum(map(math.log, r)) / len(r)):.2f}" for c, r in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({"projected": True, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
