#!/usr/bin/env python3
"""promoe (ProMoE's prefetcher) against lru and static on held-out text: the timed replay, and promoe live.

  PYTHONPATH=. .venv/bin/python tools/prefetch_table.py [--json docs/figures/prefetch-table.json] [-t 1]
                                                        [--policies lru static promoe promoe-paper dali dali-prefetch]

For each fixture and corpus: the held-out split (last 10%) traced as `edgemoe predict-eval --heldout`
traces it (calibration.traces.record_eval_trace: chunks of 512 tokens, 3/4 prefilled, 1/4 decoded,
router inputs kept; at most --max-tokens), replayed (edgemoe.policies.replay) through lru, static and
promoe (with admission control, and with ProMoE's own rule: every prediction queued), E/4 and E/2 slots
in every MoE layer, at each copy timing: infinite bandwidth, and machine profiles scaled to the
fixture's expert bytes (edgemoe.perf.model.link_timing). Counted: decode tokens (prefills are replayed).
Then promoe live on the CPU stand-in at the first profile's timing: the engine teacher-forced through the
same tokens, its copy queue paced by the timing; its decode counters, and whether the replay of its own
routes (float32 router inputs) gives the same ones. The calibration (static's frequencies, the mlp
predictor) is the bundled one: train splits only. Traces are kept in --out-dir. Prints markdown.
--policies also takes dali (DALI's replacement, window 4, the paper's update) and dali-prefetch (with its
residual-based prefetcher one layer ahead, the paper's prefetch size, the same admission as promoe).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.trace import Trace, route_steps  # noqa: E402
from edgemoe.calibration.card import find_calibration  # noqa: E402
from edgemoe.calibration.corpus import split_corpus  # noqa: E402
from edgemoe.calibration.traces import eval_prefill_tokens, eval_tokens, record_eval_trace  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.perf.model.costmodel import ModelShape  # noqa: E402
from edgemoe.perf.model.link_timing import LinkTiming, profile_timing  # noqa: E402
from edgemoe.perf.model.profile import load_profile  # noqa: E402
from edgemoe.policies.copy_queue import CopyTiming  # noqa: E402
from edgemoe.policies.dali_prefetch import DALI_PREFETCH_DISTANCE, DaliPrefetchPolicy, dali_default_prefetch  # noqa: E402
from edgemoe.policies.promoe import PromoePolicy  # noqa: E402
from edgemoe.policies.replay import ReplayResult, replay  # noqa: E402
from edgemoe.policies.residency import dali_default_update, make_policy  # noqa: E402
from edgemoe.runtime.cache_config import CacheConfig, PromoeConfig  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.expert_cache import expert_chunk_bytes  # noqa: E402
from edgemoe.runtime.prefetcher import prefetch_predictor  # noqa: E402

MODELS = [ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf", ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"]
CORPORA = [ROOT.parent / "shared" / "corpus" / "tinyshakespeare.txt", ROOT.parent / "shared" / "corpus" / "python-docs.txt"]
REFERENCE = ROOT / ".build" / "synth" / "qwen3-30b-a3b.Q4_K.gguf"  # tools/synth_gguf.py qwen3-30b-a3b
PROFILES = (("rtx4060-laptop", False), ("rtx4090-desktop", True))  # (profile, pinned)
POLICIES = ("lru", "static", "promoe", "promoe-paper")
ALL_POLICIES = (*POLICIES, "dali", "dali-prefetch")
CTX = 512


def held_out_trace(model: Path, corpus: Path, out_dir: Path, max_tokens: int, threads: int) -> Trace:
    path = out_dir / f"{model.name.split('.')[0]}-{corpus.stem}.npz"
    if path.exists():
        return Trace.load(path)
    with Engine(model, LoadConfig(n_ctx=CTX, n_threads=threads)) as eng:
        tr = record_eval_trace(eng, split_corpus(corpus).heldout_text(), ctx=CTX, max_tokens=max_tokens)
    tr.meta["heldout"] = True
    tr.save(path)
    return tr


def expert_bytes(chunks: dict[int, tuple[int, ...]]) -> float:
    return float(np.mean([sum(c) for c in chunks.values()]))


def timings(reference: Path, model_bytes: float) -> list[tuple[str, LinkTiming | None]]:
    shape = ModelShape.read(reference)
    out: list[tuple[str, LinkTiming | None]] = [("infinite bandwidth", None)]
    for name, pinned in PROFILES:
        lt = profile_timing(load_profile(name), shape, model_bytes, name=name, pinned=pinned)
        out.append((f"{name} {'pinned' if pinned else 'pageable'}", lt))
    return out


def make(kind: str, slots: dict[int, int], layers: list[int], cal: Path, preds: dict[str, Any], n_expert: int,
         timing: CopyTiming | None) -> Any:
    if kind.startswith("promoe"):
        return PromoePolicy(slots, layers, preds["promoe"], timing=timing if kind == "promoe" else None)
    if kind == "dali-prefetch":
        return DaliPrefetchPolicy(slots, layers, preds["dali"], n_expert, size=dali_default_prefetch(n_expert),
                                  update=dali_default_update(n_expert), timing=timing)
    return make_policy(kind, slots, calibration=cal, n_expert=n_expert)


def row(r: ReplayResult) -> dict[str, Any]:
    d = r.to_dict()
    d["goodpred"] = r.prefetch.goodpred if r.prefetch else None
    return d


class LiveRecorder:
    """The live run's routes with float32 router inputs, and whether each step is a decode token."""

    wants_probs = False
    wants_gate_inp = True

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, np.ndarray, np.ndarray]]] = []
        self.decode: list[bool] = []
        self.phase = False

    def on_route(self, r: Any) -> None:
        if not self.steps or r.layer <= self.steps[-1][-1][0]:
            self.steps.append([])
            self.decode.append(self.phase)
        self.steps[-1].append((r.layer, r.ids.copy(), r.gate_inp.copy()))


def live(model: Path, cal: Path, text: str, slots: int, lt: LinkTiming, max_tokens: int,
         threads: int) -> dict[str, Any]:
    """promoe in the engine on the stand-in, teacher-forced as record_eval_trace feeds: decode counters."""
    rec = LiveRecorder()
    hits = misses = 0
    t0 = time.perf_counter()
    with Engine(model, LoadConfig(n_ctx=CTX, n_threads=threads)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(slots, policy=PromoeConfig(calibration=cal,
                                                                               copy_timing=lt.timing)))
        ctl = eng.experts
        eng.set_policies([rec])
        toks = eval_tokens(eng, text, ctx=CTX, max_tokens=max_tokens)
        n_pre = eval_prefill_tokens(CTX)
        for start in range(0, len(toks), CTX):
            chunk = toks[start:start + CTX]
            eng.reset()
            ctl.counting = rec.phase = False  # type: ignore[union-attr]
            eng.feed(chunk[:n_pre], all_logits=True)
            before = cache.stats()
            ctl.counting = rec.phase = True  # type: ignore[union-attr]
            for tok in chunk[n_pre:]:
                eng.feed([tok], all_logits=True)
            after = cache.stats()
            hits += after["hits"] - before["hits"]
            misses += after["misses"] - before["misses"]
        res = ctl.driver.result  # type: ignore[union-attr]
        n_slots, chunks, layers = dict(cache.n_slots), cache.chunk_bytes, list(eng.info.moe_layers)
    pred, _ = prefetch_predictor(model, cal, "mlp", 2)
    again = replay(PromoePolicy(n_slots, layers, pred, timing=lt.timing), rec.steps, timing=lt.timing,
                   chunk_bytes=chunks, counted=rec.decode)
    pc, pa = res.prefetch, again.prefetch
    assert pc is not None and pa is not None
    same = ((hits, misses) == (again.hits, again.misses) == (res.hits, res.misses)
            and (pc.issued, pc.useful, pc.preempted) == (pa.issued, pa.useful, pa.preempted))
    return {"hit_rate": hits / (hits + misses), "tokens": res.tokens, "issued": pc.issued, "useful": pc.useful,
            "preempted": pc.preempted, "goodpred": pc.goodpred, "loads_per_token": res.loads_per_token,
            "bytes_per_token": res.bytes_per_token, "replay_of_live_routes_equal": same,
            "seconds": time.perf_counter() - t0}


def model_tables(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    info = read_model_info(model)
    cal = find_calibration(model).path
    layers, E = list(info.moe_layers), info.n_expert
    chunks = expert_chunk_bytes(model, layers)
    preds = {}
    for policy, kind, distance in (("promoe", "mlp", 2), ("dali", "residual", DALI_PREFETCH_DISTANCE)):
        preds[policy], note = prefetch_predictor(model, cal, kind, distance)
        assert note is None, note
    settings = timings(args.reference, expert_bytes(chunks))
    out: dict[str, Any] = {"model": model.name, "n_expert": E, "k": info.n_expert_used,
                           "expert_bytes": expert_bytes(chunks), "timings": {}, "replay": [], "live": []}
    for key, lt in settings:
        out["timings"][key] = None if lt is None else {"label": lt.label, "experts_per_layer": lt.experts_per_layer,
                                                      "bandwidth": lt.timing.bandwidth, "layer_s": lt.layer_s}
    for corpus in args.corpora:
        tr = held_out_trace(model, corpus, args.out_dir, args.max_tokens, args.threads)
        steps, decode = route_steps(tr)
        for slots in (E // 4, E // 2):
            n_slots = {il: slots for il in layers}
            for key, lt in settings:
                timing = lt.timing if lt is not None else None
                for kind in args.policies:
                    r = replay(make(kind, n_slots, layers, cal, preds, E, timing), steps, timing=timing,
                               chunk_bytes=chunks, counted=decode)
                    out["replay"].append({"corpus": corpus.stem, "slots": slots, "timing": key, "policy": kind,
                                          **row(r)})
                    print(f"{model.name} {corpus.stem} {slots} {key} {kind}: hit {r.hit_rate:.3f}", file=sys.stderr)
            if args.live and "promoe" in args.policies:
                lt = settings[1][1]
                assert lt is not None
                text = split_corpus(corpus).heldout_text()
                out["live"].append({"corpus": corpus.stem, "slots": slots, "timing": settings[1][0],
                                    **live(model, cal, text, slots, lt, args.max_tokens, args.threads)})
                print(f"{model.name} {corpus.stem} {slots} live: {out['live'][-1]}", file=sys.stderr)
    return out


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    lines = []
    corpora = list(dict.fromkeys(r["corpus"] for r in res["replay"]))
    lines.append(f"#### {res['model']} ({res['n_expert']} experts, top-{res['k']}, "
                 f"{res['expert_bytes'] / 1024:.0f} KiB per expert)\n")
    lines.append("hit rate / loads per token / useful share / GoodPred / PCIe KiB per token (decode tokens)\n")
    lines.append("| link | slots | policy | " + " | ".join(f"{c} (held-out)" for c in corpora) + " |")
    lines.append("|---|---|---|" + "---|" * len(corpora))
    keys = list(dict.fromkeys((r["timing"], r["slots"], r["policy"]) for r in res["replay"]))
    for timing, slots, policy in keys:
        cells = []
        for c in corpora:
            r = next(x for x in res["replay"] if (x["corpus"], x["timing"], x["slots"], x["policy"]) ==
                     (c, timing, slots, policy))
            cells.append(f"{r['hit_rate']:.3f} / {fmt(r['loads_per_token'], '.2f')} / {fmt(r['useful_share'], '.2f')}"
                         f" / {fmt(r['goodpred'], '.3f')} / {fmt(r['bytes_per_token'] / 1024, '.0f')}")
        lines.append(f"| {timing} | {slots} | {policy} | " + " | ".join(cells) + " |")
    if res["live"]:
        lines.append("\npromoe live on the CPU stand-in (decode tokens), beside its replay on the recorded trace\n")
        lines.append("| corpus | slots | link | live hit rate | replayed hit rate | live issued / useful / preempted "
                     "per token | live GoodPred | replay of the live routes equal |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for lv in res["live"]:
            rp = next(x for x in res["replay"] if (x["corpus"], x["timing"], x["slots"], x["policy"]) ==
                      (lv["corpus"], lv["timing"], lv["slots"], "promoe"))
            t = lv["tokens"]
            lines.append(f"| {lv['corpus']} | {lv['slots']} | {lv['timing']} | {lv['hit_rate']:.3f} | "
                         f"{rp['hit_rate']:.3f} | {lv['issued'] / t:.2f} / {lv['useful'] / t:.2f} / "
                         f"{lv['preempted'] / t:.2f} | {fmt(lv['goodpred'])} | "
                         f"{'yes' if lv['replay_of_live_routes_equal'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, nargs="+", default=MODELS)
    ap.add_argument("--corpora", type=Path, nargs="+", default=CORPORA)
    ap.add_argument("--reference", type=Path, default=REFERENCE,
                    help="the model whose layer time and expert bytes set the profiles' timing (a GGUF header)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "out" / "prefetch", help="where the traces are kept")
    ap.add_argument("--no-live", dest="live", action="store_false", help="replay only")
    ap.add_argument("--policies", nargs="+", choices=ALL_POLICIES, default=list(POLICIES))
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not args.reference.exists():
        sys.exit(f"{args.reference} is missing: `PYTHONPATH=. .venv/bin/python tools/synth_gguf.py qwen3-30b-a3b "
                 f"--out {args.reference}` writes it (only its header is read)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = [model_tables(m, args) for m in args.models]
    for res in results:
        print(markdown(res) + "\n")
    if results:
        print("links: " + "; ".join(f"{k}: {v['label']}" for k, v in results[0]["timings"].items() if v))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
