#!/usr/bin/env python3
"""DAOP (docs/research/daop.md) against lru and static on held-out text: placement, pre-calculation, degradation.

  PYTHONPATH=. .venv/bin/python tools/daop_eval.py placement TRACE.npz ... [--profile rtx4060-laptop] [--json F]
  PYTHONPATH=. .venv/bin/python tools/daop_eval.py precalc TRACE.npz ... [--json F]
  PYTHONPATH=. .venv/bin/python tools/daop_eval.py quality [--eval-tokens 4096] [--ratios ...] [--json F]
  PYTHONPATH=. .venv/bin/python tools/daop_eval.py similarity TRACE.npz ... [--json F]

TRACE: `edgemoe trace MODEL --input CORPUS --heldout --mode decode --gate-inputs ...` (docs/research/daop.md has the
commands). Every policy is replayed from the model's bundled calibration (train splits), never from the
held-out text; slots are equal in every MoE layer unless the row says dp.

- placement: hit rate / CPU expert executions (misses) per token / copies (loads) per token over decode
  tokens, and the decode speed the performance model projects (edgemoe.perf.model.simulate) for a real-sized
  model with the fixture's expert count and top-k (Mixtral-8x7B for the mixtral fixture, Qwen3-30B-A3B's
  layers with 32 experts, top-4, for the qwen3moe fixture), the trace's layers repeated over its depth.
- precalc: gate reuse's accuracy on DAOP's predicted CPU experts and the numpy reference's layer-output
  error of computing them on the previous layer's input (edgemoe.analysis.daop_precalc).
- quality: NLL and greedy agreement with stock of graceful degradation (llama.cpp, `edgemoe perplexity
  --degrade`'s computation) and of pre-calculation (the torch reference, edgemoe.torchref.precalc).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.trace import Trace  # noqa: E402
from edgemoe.calibration.card import find_calibration  # noqa: E402
from edgemoe.calibration.slot_alloc import allocate_slots  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.policies.allocation import decode_steps, layer_steps, replay_curve  # noqa: E402
from edgemoe.policies.daop import DaopPolicy, initial_placement, swap_pairs  # noqa: E402
from edgemoe.policies.residency import LruPolicy, StaticPolicy, load_frequency  # noqa: E402

ROWS = (("lru", "equal"), ("lru", "dp"), ("static", "equal"), ("daop", "equal"), ("daop", "dp"))
PROMPT = 32  # quality: prompt tokens of every chunk (DAOP swaps by them; never degraded or pre-calculated)
CTX = 256
WORK = ROOT / ".build" / "daop"  # shape-only GGUFs of the projection (sparse files); --work


def _freqs(model: Path) -> tuple[Path, dict[int, np.ndarray], dict[int, np.ndarray]]:
    info = read_model_info(model)
    cal = find_calibration(model).path
    layers = list(info.moe_layers)
    return (cal, load_frequency(cal, n_expert=info.n_expert, layers=layers),
            load_frequency(cal, n_expert=info.n_expert, layers=layers, phase="decode"))


def _name(tr: Trace) -> str:
    return f"{Path(str(tr.meta.get('input', '?'))).stem.removeprefix('heldout-')}, prompt {tr.meta['prefill_tokens']}"


def _load(paths: list[Path]) -> dict[Path, list[Trace]]:
    by_model: dict[Path, list[Trace]] = {}
    for p in paths:
        tr = Trace.load(p)
        by_model.setdefault(Path(str(tr.meta["model"])), []).append(tr)
    return by_model


# -- placement --------------------------------------------------------------------------------------
def placement(model: Path, traces: list[Trace], profile: str) -> dict[str, Any]:
    info = read_model_info(model)
    E, layers = info.n_expert, list(info.moe_layers)
    cal, freq_all, freq_dec = _freqs(model)
    out: dict[str, Any] = {"model": model.name, "n_expert": E, "rows": [], "projected": []}
    for tr in traces:
        ub = int(tr.meta.get("n_batch", 512))
        by_layer = layer_steps(tr.ids, [int(x) for x in tr.layers], tr.phase, tr.seq, ubatch=ub)
        dec = decode_steps(tr.phase, tr.seq, ubatch=ub)
        curves = {pol: {il: replay_curve(s, pol, E, n_expert=E, counted=dec,
                                         frequency=(freq_dec if pol == "daop" else freq_all)[il])
                        for il, s in by_layer.items()} for pol in ("lru", "static", "daop")}
        for per_layer in (E // 4, E // 2):
            for pol, alloc in ROWS:
                slots = ({il: per_layer for il in layers} if alloc == "equal" else
                         allocate_slots(info, alloc="dp", policy=pol, calibration=cal, slots_per_layer=per_layer).slots)
                c = curves[pol]
                routed, tokens = sum(x.routed for x in c.values()), next(iter(c.values())).tokens
                misses = sum(int(c[il].misses[t]) for il, t in slots.items())
                loads = sum(int(c[il].loads[t]) for il, t in slots.items())
                out["rows"].append({"trace": _name(tr), "slots": per_layer, "policy": pol, "alloc": alloc,
                                    "hit_rate": 1 - misses / routed, "cpu_per_token": misses / tokens,
                                    "loads_per_token": loads / tokens})
        out["projected"] += projected(model, tr, profile, freq_all, freq_dec)
    return out


def _big_shape(model: Path) -> tuple[Path, str]:
    """A shape-only (sparse) GGUF of a real-sized model with the fixture's expert count and top-k."""
    from edgemoe.gguf.presets import get_preset
    from edgemoe.gguf.synth import write_synthetic

    info = read_model_info(model)
    if (info.n_expert, info.n_expert_used) == (8, 2):
        preset, label = get_preset("mixtral-8x7b"), "Mixtral-8x7B"
    else:
        base = get_preset("qwen3-30b-a3b")
        preset = dataclasses.replace(base, name=f"qwen3-30b-a3b-e{info.n_expert}k{info.n_expert_used}",
                                     n_expert=info.n_expert, n_expert_used=info.n_expert_used)
        label = f"Qwen3-30B-A3B layers, {info.n_expert} experts, top-{info.n_expert_used}"
    path = WORK / f"{preset.name}.shape.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(preset, path, shape_only=True, progress=False)
    return path, label


def projected(model: Path, tr: Trace, profile: str, freq_all: dict[int, np.ndarray],
              freq_dec: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    from edgemoe.perf.model.costmodel import ModelShape
    from edgemoe.perf.model.profile import load_profile
    from edgemoe.perf.model.simulate import Config, estimate_graph_nodes, run_config
    from edgemoe.perf.model.workload import build_workload

    path, label = _big_shape(model)
    shape, prof = ModelShape.read(path), load_profile(profile)
    E, k, moe = shape.n_expert, shape.n_expert_used, shape.moe_layers
    work = build_workload(tr, moe, E, k, n_ubatch=int(tr.meta.get("n_batch", 512)))
    src = [int(x) for x in tr.layers]
    remap = lambda f: {il: f[src[j % len(src)]] for j, il in enumerate(moe)}  # noqa: E731
    rows = []
    for per_layer in (E // 4, E // 2):
        slots = {il: per_layer for il in moe}
        fresh = {"lru": lambda: LruPolicy(dict(slots)),  # noqa: B023 - called within the iteration
                 "static": lambda: StaticPolicy(remap(freq_all), dict(slots)),  # noqa: B023
                 "daop": lambda: DaopPolicy(remap(freq_dec), dict(slots), E)}  # noqa: B023
        for pol in ("lru", "static", "daop"):
            for overlap in (False, True):
                r = run_config(Config(pol, "edgemoe", policy=pol, slots=slots), work, shape, prof,
                               estimate_graph_nodes(shape), on_gpu=True, overlap=overlap, policy=fresh[pol]())
                rows.append({"trace": _name(tr), "shape": label, "profile": profile, "slots": per_layer,
                             "policy": pol, "overlap": overlap, "decode_tps": r.decode_tps,
                             "decode_hit_rate": r.decode_hit_rate, "pcie_mb_per_token": r.pcie_bytes_per_token / 1e6,
                             "bottleneck": r.bottleneck})
    return rows


def similarity(model: Path, traces: list[Trace]) -> dict[str, Any]:
    """DAOP's eq. 1 per sequence: the mean over layers of the cosine between the expert activation
    counts of the sequence's prompt and of its decoded tokens (Table II), averaged over sequences."""
    out: dict[str, Any] = {"model": model.name, "traces": {}}
    E = read_model_info(model).n_expert
    for tr in traces:
        sims = []
        for s in np.unique(tr.seq):
            rows = tr.seq == s
            pre, dec = tr.ids[rows & (tr.phase == 0)], tr.ids[rows & (tr.phase == 1)]
            if not len(pre) or not len(dec):
                continue
            per_layer = []
            for j in range(tr.ids.shape[1]):
                p = np.bincount(pre[:, j][pre[:, j] >= 0], minlength=E).astype(float)
                d = np.bincount(dec[:, j][dec[:, j] >= 0], minlength=E).astype(float)
                per_layer.append(p @ d / (np.linalg.norm(p) * np.linalg.norm(d)))
            sims.append(np.mean(per_layer))
        out["traces"][_name(tr)] = float(np.mean(sims))
    return out


# -- pre-calculation --------------------------------------------------------------------------------
def precalc(model: Path, traces: list[Trace]) -> dict[str, Any]:
    from edgemoe.analysis.daop_precalc import decode_residency, precalc_accuracy, precalc_quality
    from edgemoe.gguf.routers import load_routers

    info = read_model_info(model)
    E, layers = info.n_expert, list(info.moe_layers)
    _, _, freq_dec = _freqs(model)
    out: dict[str, Any] = {"model": model.name, "accuracy": [], "layer_error": []}
    for tr in traces:
        for per_layer in (E // 4, E // 2):
            res = decode_residency(tr, DaopPolicy(freq_dec, {il: per_layer for il in layers}, E))
            acc = precalc_accuracy(tr, load_routers(str(model), layers), res)
            out["accuracy"].append({"trace": _name(tr), "slots": per_layer,
                                    "per_layer": [dataclasses.asdict(a) for a in acc]})
            if per_layer == E // 4:
                q = precalc_quality(tr, model, res)
                out["layer_error"].append({"trace": _name(tr), "slots": per_layer,
                                           "per_layer": [dataclasses.asdict(x) for x in q]})
    return out


# -- quality: NLL and greedy agreement ----------------------------------------------------------------
def _prompt_residency(freq_dec: dict[int, np.ndarray], layers: list[int], per_layer: int, E: int) -> Any:
    import torch

    def resident(j: int, prompt_ids: Any) -> Any:
        flat = prompt_ids.reshape(-1).numpy()
        res = set(initial_placement(freq_dec[layers[j]], per_layer))
        for e_in, e_out in swap_pairs(np.bincount(flat, minlength=E), res):
            res.discard(e_out)
            res.add(e_in)
        m = torch.zeros(E, dtype=torch.bool)
        m[sorted(res)] = True
        return m
    return resident


def quality(model: Path, eval_tokens: int, ratios: list[float], threads: int) -> list[dict[str, Any]]:
    import torch

    from edgemoe.analysis.daop import daop_degradation, greedy_agreement
    from edgemoe.analysis.perplexity import chunk_tokens, log_softmax_nll, perplexity
    from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
    from edgemoe.runtime.engine import Engine, LoadConfig
    from edgemoe.runtime.sampling import GREEDY
    from edgemoe.torchref.gguf_import import load_gguf_model
    from edgemoe.torchref.precalc import PrecalcCounts, forward_precalc

    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    cal, _, freq_dec = _freqs(model)
    ref = load_gguf_model(model)
    rows: list[dict[str, Any]] = []
    with Engine(model, LoadConfig(n_ctx=2 * CTX, n_batch=2 * CTX, n_ubatch=2 * CTX, n_threads=threads)) as eng:
        E, layers = eng.info.n_expert, list(eng.info.moe_layers)
        bos = eng.bos_token() if eng.adds_bos() else None
        for corpus in ("tinyshakespeare", "python-docs"):
            toks = eng.tokenize(split_corpus(default_corpus_dir() / f"{corpus}.txt").heldout_text(),
                                add_special=False)[:eval_tokens]
            base = perplexity(eng, toks, ctx=CTX, score_from=PROMPT)
            prompt = toks[:PROMPT]
            eng.reset()
            cont = eng.generate(prompt, max_tokens=256, sampling=GREEDY, ignore_eog=True).tokens
            row0 = {"model": model.name, "corpus": corpus, "base_nll": base.nll,
                    "base_agreement": greedy_agreement(eng, prompt, cont)}
            for per_layer in (E // 4, E // 2):
                for r in ratios:  # graceful degradation through llama.cpp
                    pols = daop_degradation(eng, cal, slots=per_layer, ratio=r, prompt_tokens=PROMPT)
                    res = perplexity(eng, toks, ctx=CTX, policies=list(pols), score_from=PROMPT)
                    deg = pols[1]
                    agree = greedy_agreement(eng, prompt, cont, list(daop_degradation(
                        eng, cal, slots=per_layer, ratio=r, prompt_tokens=PROMPT)))
                    rows.append({**row0, "kind": "degrade", "slots": per_layer, "ratio": r, "nll": res.nll,
                                 "nll_rel": res.nll / base.nll - 1, "agreement": agree,
                                 "cpu_per_token": deg.n_cpu / res.tokens, "cpu_avoided": deg.cpu_avoided})
                resident = _prompt_residency(freq_dec, layers, per_layer, E)
                chunks = [c for c in chunk_tokens(toks, CTX, bos) if len(c) > PROMPT + 1]  # perplexity's
                ref_nll = None
                for first, renorm in ((1, False), (1, True), (5, False), (5, True), (None, False)):
                    counts, nll, n = PrecalcCounts(), 0.0, 0
                    for c in chunks:  # the torch reference; (None): no pre-calculation, its own baseline
                        lg = forward_precalc(ref, torch.tensor(c), resident, start=PROMPT, first_target=first or 1,
                                             renorm=renorm, enabled=first is not None, counts=counts).numpy()
                        nll += log_softmax_nll(lg[PROMPT:-1], np.array(c[PROMPT + 1:]))
                        n += len(c) - 1 - PROMPT
                    pl = forward_precalc(ref, torch.tensor([*prompt, *cont[:-1]]), resident, start=PROMPT,
                                         first_target=first or 1, renorm=renorm, enabled=first is not None)
                    agree = float((pl.numpy()[PROMPT - 1:].argmax(-1) == np.array(cont)).mean())
                    rows.append({**row0, "kind": "precalc", "slots": per_layer, "first_target": first,
                                 "renorm": renorm, "nll": nll / n, "agreement": agree,
                                 "precalc_share": counts.precalc / counts.cpu if counts.cpu else None})
                    if first is None:
                        ref_nll = nll / n
                for row in rows:
                    if row["kind"] == "precalc" and row["slots"] == per_layer and row["corpus"] == corpus \
                            and row["model"] == model.name:
                        row["nll_rel"] = row["nll"] / ref_nll - 1  # against the torch reference's own NLL
            print(json.dumps(row0), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["placement", "precalc", "quality", "similarity"])
    ap.add_argument("traces", nargs="*", type=Path)
    ap.add_argument("--profile", default="rtx4060-laptop", help="placement: machine profile of the projection")
    ap.add_argument("--models", nargs="+", type=Path, default=sorted((ROOT / "models").glob("*.gguf")))
    ap.add_argument("--eval-tokens", type=int, default=4096, help="quality: held-out tokens per corpus")
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.9, 0.8, 0.6, 0.4])
    ap.add_argument("-t", "--threads", type=int, default=1, help="quality: llama.cpp threads")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=WORK, help="where the projection's shape-only GGUFs go")
    args = ap.parse_args()
    globals()["WORK"] = args.work
    if args.what == "quality":
        res: Any = [row for m in args.models for row in quality(m, args.eval_tokens, args.ratios, args.threads)]
    else:
        fns = {"placement": lambda m, t: placement(m, t, args.profile), "precalc": precalc, "similarity": similarity}
        res = [fns[args.what](m, trs) for m, trs in _load(args.traces).items()]
    text = json.dumps(res, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
