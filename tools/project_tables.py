#!/usr/bin/env python3
"""Projected tables (docs/research/performance-model.md): model shapes x bundled profiles x VRAM budgets.

Every figure is a projection of `edgemoe simulate` (edgemoe.perf.model.simulate) from a specification
profile, replaying a routing trace. By default (`--routing real`) the trace is drawn from the bundled
routing profile of real models for the shape (edgemoe.analysis.routing_profile: Qwen3-30B-A3B and
Mixtral-8x7B their own, gpt-oss-20b the nearest, OLMoE's), four prompts of 256 tokens then 256 generated;
`--routing fixture` replays the tiny trained fixtures' traces as the tables did before the real models' routing
profiles (2026-11-25; a toy: far less local than real models; the only routing with router weights, hence the only
one with gated rows).

    .venv/bin/python tools/synth_gguf.py qwen3-30b-a3b --shape-only --out .build/shapes/qwen3-30b-a3b.Q4_K.gguf
    .venv/bin/python tools/synth_gguf.py gpt-oss-20b --type MXFP4 --shape-only --out .build/shapes/gpt-oss-20b.MXFP4.gguf
    .venv/bin/python tools/synth_gguf.py mixtral-8x7b --shape-only --out .build/shapes/mixtral-8x7b.Q4_K.gguf
    .venv/bin/python tools/project_tables.py --markdown --json docs/figures/projected-tables.json
    .venv/bin/python tools/project_tables.py --summary docs/figures/projected-tables.json   # the docs' table
    .venv/bin/python tools/project_tables.py --policies docs/figures/projected-policies.json   # every policy, 8 GiB
    .venv/bin/python tools/project_tables.py --device-prefill docs/figures/projected-device-prefill.json   # device prefill
    .venv/bin/python tools/project_tables.py --precalc docs/figures/projected-precalc.json   # 0026, rates from
        # docs/figures/daop-precalc-run.json (tools/precalc_eval.py)
    .venv/bin/python tools/project_tables.py --decode-split docs/figures/projected-decode-split.json   # not built

With `--routing fixture` the fixtures' traces are needed first:

    for m in qwen3moe mixtral; do .venv/bin/edgemoe trace models/edgemoe-tiny-$m.Q4_K_M.gguf \
        --input .build/traces/heldout-python-docs.txt --out .build/traces/$m-python-docs.npz \
        --max-tokens 4096 --ctx 512 --mode decode --prefill-tokens 256; done   # held-out 10% of python-docs
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.analysis.routing_model import routing_stats, synthesize_trace  # noqa: E402
from edgemoe.analysis.routing_profile import profile_for_shape  # noqa: E402
from edgemoe.analysis.trace import Trace  # noqa: E402
from edgemoe.perf.model.costmodel import ModelShape  # noqa: E402
from edgemoe.perf.model.profile import load_profile  # noqa: E402
from edgemoe.perf.model.simulate import ConfigResult, PrecalcSpec, SimResult, SimSpec, simulate  # noqa: E402
from edgemoe.perf.model.workload import GatingSpec  # noqa: E402
from edgemoe.plan.budget import slot_budget  # noqa: E402
from edgemoe.plan.reserve import Reserve, reserve_bytes  # noqa: E402
from edgemoe.policies.gating import GatingRule  # noqa: E402

B = Path(".build")
SHAPES = {  # shape -> (GGUF with its header, routing trace, what the trace is)
    "Qwen3-30B-A3B": (B / "shapes/qwen3-30b-a3b.Q4_K.gguf", None,
                      "synthetic: 128 experts, top-8, 48 layers drawn by edgemoe.analysis.routing_model with the "
                      "concentration and token-to-token reuse of the trained qwen3moe fixture on held-out Python "
                      "docs (its 8 layers' statistics reused in turn); no gated rows (the drawn weights mean nothing)"),
    "gpt-oss-20b": (B / "shapes/gpt-oss-20b.MXFP4.gguf", B / "traces/qwen3moe-python-docs.npz",
                    "trained tiny qwen3moe fixture (32 experts, top-4, as gpt-oss-20b) on held-out Python docs, "
                    "its 8 MoE layers reused in turn for the 24"),
    "Mixtral-8x7B": (B / "shapes/mixtral-8x7b.Q4_K.gguf", B / "traces/mixtral-python-docs.npz",
                     "trained tiny Mixtral-style fixture (8 experts, top-2) on held-out Python docs, its 8 MoE "
                     "layers reused in turn for the 32"),
}
PROFILES = ("rtx4060-laptop", "rtx4090-desktop", "h100-server")
BUDGETS_GIB = (6, 8, 12)
GATE = GatingSpec(GatingRule.SER, 0.4)
# the fixture whose routing each shape replays: its pre-calculation rates measured through llama.cpp
PRECALC_FIXTURE = {"Qwen3-30B-A3B": "edgemoe-tiny-qwen3moe", "gpt-oss-20b": "edgemoe-tiny-qwen3moe",
                   "Mixtral-8x7B": "edgemoe-tiny-mixtral"}
PRECALC_RUN = Path("docs/figures/daop-precalc-run.json")
POLICIES = ("lru", "static", "dali", "daop")


ROUTING = {"routing": "real"}  # --routing: "real" (bundled profiles of real models) or "fixture" (the toy)


def _trace(trace_path: Path | None, model: Path | None = None) -> Trace:
    """The shape's routing: drawn from the bundled real-model profile of its expert count and top-k (else the
    nearest), or with --routing fixture the fixtures' traces as before."""
    if ROUTING["routing"] == "real" and model is not None:
        info = ModelShape.read(model)
        prof, _ = profile_for_shape(info.n_expert, info.n_expert_used)
        return prof.synthesize(n_expert=info.n_expert, k=info.n_expert_used, n_layer=len(info.moe_layers),
                               n_seq=4, prefill=256, decode=256)
    if trace_path is None:
        stats = routing_stats(Trace.load(B / "traces/qwen3moe-python-docs.npz"))
        return synthesize_trace(stats, n_expert=128, k=8, n_layer=48, n_seq=4, prefill=256, decode=256)
    return Trace.load(trace_path)


def routing_label(model: Path, what: str) -> str:
    """What routing a shape's rows replay, for the tables' headings."""
    if ROUTING["routing"] != "real":
        return f"fixture (a toy): {what}"
    info = ModelShape.read(model)
    prof, exact = profile_for_shape(info.n_expert, info.n_expert_used)
    return prof.name if exact else f"~{prof.name} (the nearest bundled profile)"


def _projections(spec: SimSpec) -> Iterator[tuple[str, Path, str, SimResult, dict[str, ConfigResult], ConfigResult,
                                                  float]]:
    """Each shape on each bundled profile under spec: (shape, model, profile, result, configurations by name, the
    best stock configuration's decode, the best stock prefill tok/s)."""
    for shape, (model, trace_path, _) in SHAPES.items():
        trace = _trace(trace_path, model)
        for prof_name in PROFILES:
            res = simulate(model, trace, load_profile(prof_name), spec)
            stock = [c for c in res.configs if c.kind == "stock"]
            yield (shape, model, prof_name, res, {c.name: c for c in res.configs},
                   max(stock, key=lambda c: c.decode_tps), max(c.prefill_tps for c in stock))


def project_policies(out: Path, gib: int) -> None:
    """Each residency policy at one budget, overlap on (the build's default): its decode hit rate and decode
    speed against lru's and against the best stock configuration's: which features do not pay.
    static and daop are placed by the trace's first half of sequences and every configuration replays the
    second half (simulate's rule without a calibration)."""
    rows = []
    print(f"PROJECTED, {gib} GiB, decode: tok/s (x lru), decode hit rate\n")
    print("| shape | profile | routing | best stock decode | lru | static | dali | daop |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, model, prof_name, res, by, dec, _ in _projections(
            SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True, policies=POLICIES)):
        lru = by["edgemoe-lru"].decode_tps
        cells = []
        for p in POLICIES:
            c = by["edgemoe-" + p]
            ratio = "" if p == "lru" else f" ({c.decode_tps / lru:.2f}x)"
            cells.append(f"{c.decode_tps:.1f}{ratio}, {c.decode_hit_rate:.2f}")
        print(f"| {shape} | {prof_name} | {routing_label(model, '')} | {dec.decode_tps:.1f} ({dec.name}) | "
              f"{' | '.join(cells)} |")
        rows += [{"shape": shape, "profile": prof_name, "vram_gib": gib, "routing": routing_label(model, ""),
                  "workload_note": res.workload_note, **c.__dict__} for c in res.configs]
    out.write_text(json.dumps({"projected": True, "overlap": True, "routing": ROUTING["routing"],
                               "rows": rows}, indent=1) + "\n")


def project_device_prefill(out: Path, gib: int) -> None:
    """Prefill with --device-prefill against the best stock configuration and edgemoe without it,
    overlap on: every routed expert on the GPU, the experts outside the slots copied one cached layer ahead."""
    rows = []
    print(f"PROJECTED, {gib} GiB, tok/s, x best stock\n")
    print("| shape | profile | slots/layer (with the buffers) | best stock prefill | lru | lru +device prefill | "
          "static | static +device prefill | decode: static | static +device prefill |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape, model, prof_name, res, by, dec_stock, pre in _projections(
            SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True, policies=("lru", "static"), device_prefill=True)):
        dec = dec_stock.decode_tps
        names = ("edgemoe-lru", "edgemoe-lru-device-prefill", "edgemoe-static", "edgemoe-static-device-prefill")
        cells = [f"{by[n].prefill_tps:.0f} ({by[n].prefill_tps / pre:.2f}x)" for n in names]
        cells += [f"{by[n].decode_tps:.1f} ({by[n].decode_tps / dec:.2f}x)" for n in names[2:]]
        info = ModelShape.read(model).info
        with_buf = slot_budget(info, gib * 2**30, n_ctx=4096,
                               reserve_bytes=reserve_bytes(info, 4096, Reserve(device_prefill=True))).experts_per_layer
        print(f"| {shape} | {prof_name} | {res.slots_per_layer} ({with_buf}) | {pre:.0f} | {' | '.join(cells)} |")
        rows += [{"shape": shape, "profile": prof_name, "vram_gib": gib, "workload_note": res.workload_note,
                  "slots_with_buffers": with_buf, **c.__dict__} for c in res.configs]
    out.write_text(json.dumps({"projected": True, "overlap": True, "rows": rows}, indent=1) + "\n")


def precalc_rules(fixture: str, n_layer: int, run: dict) -> dict[str, tuple[PrecalcSpec, dict]]:
    """The two rules tools/precalc_eval.py measured on a fixture's 8 MoE layers, scaled to a model of n_layer
    layers: "late" (targets 5-7 there: the last 3/8 of the layers) and "all" (from layer 1), each with the rates
    summed over that fixture's rows (both corpora, both slot counts) and its NLL change range; and "perfect", every
    layer from 1 with every CPU expert predicted and nothing wasted (the mechanism's ceiling, not a measurement)."""
    out = {}
    for rule, first_fixture, first in (("late", 5, n_layer - round(3 * n_layer / 8)), ("all", 1, 1)):
        rows = [r for r in run["rows"] if r["model"] == fixture and r["first_layer"] == first_fixture]
        if not rows:
            raise SystemExit(f"{PRECALC_RUN} has no {fixture} rows from layer {first_fixture}: run "
                             "tools/precalc_eval.py first")
        used, late, computed = (sum(r["stats"][k] for r in rows) for k in ("used", "late", "computed"))
        nll = [r["nll_change"] for r in rows]
        out[rule] = (PrecalcSpec(first, used / (used + late), used / computed),
                     {"first_layer": first, "recall": used / (used + late), "precision": used / computed,
                      "nll_change_min": min(nll), "nll_change_max": max(nll), "fixture_rows": len(rows)})
    out["perfect"] = (PrecalcSpec(1, 1.0, 1.0), {"first_layer": 1, "recall": 1.0, "precision": 1.0})
    return out


def project_precalc(out: Path, gib: int) -> None:
    """DAOP's pre-calculation at one budget, overlap on: daop's decode without it, with it on the last
    3/8 of the layers and from layer 1, at the rates and with the NLL cost measured through llama.cpp on the fixture
    whose routing the shape replays (docs/figures/daop-precalc-run.json)."""
    run = json.loads(PRECALC_RUN.read_text())
    rows = []
    print(f"PROJECTED, {gib} GiB, decode tok/s, x daop without it\n")
    print("| shape | profile | best stock decode | daop | daop +precalc late | daop +precalc all | daop +precalc "
          "perfect | rates late, all (recall / precision from layer) | NLL change late, all (measured) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for shape, (model, trace_path, _) in SHAPES.items():
        trace = _trace(trace_path, model)
        rules = precalc_rules(PRECALC_FIXTURE[shape], ModelShape.read(model).info.n_layer, run)
        for prof_name in PROFILES:
            prof = load_profile(prof_name)
            by: dict[str, ConfigResult] = {}
            for rule, (pc, meta) in rules.items():
                res = simulate(model, trace, prof, SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True,
                                                           policies=("daop",), precalc=pc))
                for c in res.configs:
                    c.name += f" {rule}" if c.name.endswith("-precalc") else ""
                    if c.name not in by:
                        by[c.name] = c
                        rows.append({"shape": shape, "profile": prof_name, "vram_gib": gib,
                                     "workload_note": res.workload_note, "slots_per_layer": res.slots_per_layer,
                                     "precalc": meta if c.name.endswith(rule) else None, **c.__dict__})
            dec = max((c for c in by.values() if c.kind == "stock"), key=lambda c: c.decode_tps)
            daop = by["edgemoe-daop"].decode_tps
            cells = [f"{daop:.1f} ({daop / dec.decode_tps:.2f}x stock)"]
            cells += [f"{by[n].decode_tps:.1f} ({by[n].decode_tps / daop:.2f}x)"
                      for n in ("edgemoe-daop-precalc late", "edgemoe-daop-precalc all", "edgemoe-daop-precalc perfect")]
            measured = [m for rule, (_, m) in rules.items() if rule != "perfect"]
            rates = ", ".join(f"{m['recall']:.2f} / {m['precision']:.2f} from {m['first_layer']}" for m in measured)
            nll = ", ".join(f"{100 * m['nll_change_min']:+.2f}% to {100 * m['nll_change_max']:+.2f}%" for m in measured)
            print(f"| {shape} | {prof_name} | {dec.decode_tps:.1f} ({dec.name}) | {' | '.join(cells)} | {rates} | "
                  f"{nll} |")
    out.write_text(json.dumps({"projected": True, "overlap": True, "rates_from": str(PRECALC_RUN), "rows": rows},
                              indent=1) + "\n")


def project_decode_split(out: Path, gib: int) -> None:
    """static's decode with the FreeToken-style split of each layer's CPU experts (simulate's decode_split: cpu,
    whole copy or a row split by the decode-miss cost model), overlap on. The runtime has no row-split path: this
    projects what building one could win."""
    rows = []
    print(f"PROJECTED, {gib} GiB, decode tok/s; the split is not built\n")
    print("| shape | profile | best stock decode | static | static +decode split | PCIe MB/token with the split |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for shape, _, prof_name, res, by, dec, _ in _projections(
            SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True, policies=("static",), decode_split=True)):
        st, sp = by["edgemoe-static"], by["edgemoe-static-decode-split"]
        print(f"| {shape} | {prof_name} | {dec.decode_tps:.1f} ({dec.name}) | {st.decode_tps:.1f} "
              f"({st.decode_tps / dec.decode_tps:.2f}x) | {sp.decode_tps:.1f} ({sp.decode_tps / st.decode_tps:.2f}x "
              f"static) | {sp.pcie_bytes_per_token / 1e6:.0f} |")
        rows += [{"shape": shape, "profile": prof_name, "vram_gib": gib, "workload_note": res.workload_note,
                  **c.__dict__} for c in res.configs]
    out.write_text(json.dumps({"projected": True, "overlap": True, "built": False, "rows": rows}, indent=1) + "\n")


def print_summary(rows: list[dict]) -> None:
    """One row per shape, profile and budget: best stock, static, + overlap, prefill assignment, lru."""
    print("| shape | profile | VRAM | slots/layer | best stock decode | edgemoe static decode | static hit rate | "
          "+ overlap decode | best stock prefill | edgemoe static prefill | + ratio assignment prefill | "
          "edgemoe lru decode |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["profile"], r["vram_gib"]), {})[r["name"]] = r
    for (shape, prof, gib), by in groups.items():
        stock = [r for r in by.values() if r["kind"] == "stock"]
        dec = max(stock, key=lambda r: r["decode_tps"])
        pre = max(r["prefill_tps"] for r in stock)
        st, ov = by["edgemoe-static"], by["edgemoe-static +overlap"]
        asg, lru = by["edgemoe-static-ratio-assign +overlap"], by["edgemoe-lru"]
        slots = next(iter(by.values()))["slots_per_layer"]
        print(f"| {shape} | {prof} | {gib} GiB | {slots} | {dec['decode_tps']:.1f} ({dec['name']}) | "
              f"{st['decode_tps']:.1f} ({st['decode_tps'] / dec['decode_tps']:.2f}x) | {st['hit_rate']:.2f} | "
              f"{ov['decode_tps']:.1f} ({ov['decode_tps'] / dec['decode_tps']:.2f}x) | {pre:.0f} | "
              f"{st['prefill_tps']:.0f} | {asg['prefill_tps']:.0f} ({asg['prefill_tps'] / pre:.2f}x) | "
              f"{lru['decode_tps']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--policies", type=Path, default=None, metavar="JSON",
                    help="write every residency policy (lru, static, dali, daop) at --policies-gib on each bundled "
                         "profile, CPU/GPU overlap on, to this file and print its table, and stop")
    ap.add_argument("--policies-gib", type=int, default=8)
    ap.add_argument("--device-prefill", type=Path, default=None, metavar="JSON",
                    help="write prefill with and without --device-prefill at --policies-gib on each "
                         "bundled profile to this file and print its table, and stop")
    ap.add_argument("--precalc", type=Path, default=None, metavar="JSON",
                    help="write daop's decode with and without DAOP's pre-calculation at --policies-gib "
                         "on each bundled profile to this file and print its table, and stop")
    ap.add_argument("--decode-split", type=Path, default=None, metavar="JSON",
                    help="write static's decode with and without the FreeToken-style decode split (not built) at "
                         "--policies-gib on each bundled profile to this file and print its table, and stop")
    ap.add_argument("--summary", type=Path, default=None, metavar="JSON",
                    help="print docs/research/performance-model.md's one-row-per-budget table from a --json file, and stop")
    ap.add_argument("--routing", choices=("real", "fixture"), default="real",
                    help="real: traces drawn from the bundled routing profiles of real models (default); "
                         "fixture: the tiny trained fixtures' traces (a toy, far less local), as the tables "
                         "were before the real models' routing profiles")
    args = ap.parse_args()
    ROUTING["routing"] = args.routing
    if args.summary is not None:
        print_summary(json.loads(args.summary.read_text())["rows"])
        return
    one_budget = {args.policies: project_policies, args.device_prefill: project_device_prefill,
                  args.precalc: project_precalc, args.decode_split: project_decode_split}
    for out_json, project in one_budget.items():
        if out_json is not None:
            project(out_json, args.policies_gib)
            return
    out = []
    for shape, (model, trace_path, what) in SHAPES.items():
        trace = _trace(trace_path, model)
        # drawn routing has no router weights: gated rows only on the fixtures' traces
        gated = trace_path is not None and ROUTING["routing"] == "fixture"
        if args.markdown:
            print(f"\n### {shape} (PROJECTED; routing: {routing_label(model, what)})\n")
            print("| profile | VRAM | slots/layer | configuration | decode tok/s | prefill tok/s | hit rate | "
                  "PCIe MB/token | bottleneck |")
            print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
        for prof_name in PROFILES:
            prof = load_profile(prof_name)
            for gib in BUDGETS_GIB:
                res = simulate(model, trace, prof, SimSpec(vram=gib * 2**30, n_ctx=4096, gated=gated),
                               gating=GATE if gated else None)
                for ov in (False, True):
                    if ov:  # CPU/GPU overlap and DALI-style prefill assignment (not built; docs/research/assignment.md)
                        extra = simulate(model, trace, prof, SimSpec(vram=gib * 2**30, n_ctx=4096, overlap=True,
                                                                     policies=("static",), assign="ratio"))
                        rows = [c for c in extra.configs if c.kind == "edgemoe"]
                        for c in rows:
                            c.name += " +overlap"
                    else:
                        rows = res.configs
                    for c in rows:
                        out.append({"shape": shape, "profile": prof_name, "vram_gib": gib,
                                    "slots_per_layer": res.slots_per_layer, **c.__dict__})
                        if args.markdown:
                            hit = f"{c.hit_rate:.3f}" if c.hit_rate is not None else "-"
                            print(f"| {prof_name} | {gib} GiB | {res.slots_per_layer} | {c.name} | {c.decode_tps:.1f} | "
                                  f"{c.prefill_tps:.0f} | {hit} | {c.pcie_bytes_per_token / 1e6:.1f} | {c.bottleneck} |")
    if args.json:
        args.json.write_text(json.dumps({"projected": True, "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
