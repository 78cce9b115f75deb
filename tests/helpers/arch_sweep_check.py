"""The in-process checks of tests/test_arch_sweep.py, run in a child process per model.

    python tests/helpers/arch_sweep_check.py MODEL CHECK [CHECK ...]

prints one line `@@ {"check", "ok", "detail", ...}` per check as it finishes. A llama.cpp abort
kills this process only: the parent blames the first check without a line and runs the rest again.

Checks, each against stock llama.cpp on the same GGUF:
- generate: Engine.generate, greedy, N_GEN tokens == llama_cpp.Llama's greedy ids.
- gating-top1: adaptive top-k keeping the top-1 expert (score, threshold 0), in the graph and in the
  routing hook, == stock with expert_used_count = 1, bitwise (for k = 2 that is drop-last == k - 1).
- cache: the expert cache (lru, CPU stand-in device) with 1 slot and with a slot per expert ==
  stock logits bitwise, over a prefill and single-token decode steps, with its tables in the graph
  (no host sync).
- cache-static: the static policy (half the experts per layer, at least one), calibrated on first use
  (edgemoe.calibration.auto, a small calibration into a temporary cache directory) == stock logits
  bitwise, with hits.
- cache-daop: the daop policy the same way (DAOP's placement, a swap after the prompt, run natively: patch
  native policies), with no host sync.
- cache-dali: DALI's workload-aware replacement run natively (half the experts per layer, at
  least one, a window of 2 tokens) == stock logits bitwise, with hits and loads and no host sync.
- cache-dali-prefetch: dali with its residual-based prefetcher (gate reuse without a calibration), one slot
  per layer, == stock logits bitwise (on the .k1 copies, as cache-promoe).
- cache-promoe: ProMoE's prefetcher inside llama.cpp (gate reuse one layer ahead: no calibration), one slot per layer,
  == stock logits bitwise (on the .k1 copies, see the check).
- cache-assign: lru with the ratio CPU/GPU assigner (`--assign`, a bundled profile's costs for the file's
  shapes), one slot per layer, == stock logits bitwise, with routes weighed (on the .k1 copies).
- cache-degrade: DAOP's graceful degradation at r = 1 (exact ties only), one slot per layer, == stock
  logits bitwise, with every decode route's router probabilities read (on the .k1 copies).
- speculate: greedy with speculative decoding (prompt lookup, and the model drafting for itself) and the lru
  cache (1 slot, CPU stand-in device) == the engine's greedy one token per decode.
- cache-precalc: DAOP's pre-calculation from layer 1 on, no expert resident: the prompt's rows
  == stock bitwise, the decode rows finite, every MoE layer after a MoE layer taking experts early in every
  decode step (with k = 2 of 2 experts the prediction names every routed expert: none late); with every
  expert resident nothing is computed early and the logits are stock's bitwise.
- context-tiers: the context created in steps (256 then 512 tokens, the lru cache with half the experts then
  one slot): filled across the step (the K/V carried over), a new prompt that sends it back to the first step, a
  snapshot restored into the last == stock logits bitwise; a model whose output a re-created context would
  change (edgemoe.runtime.context_tiers.tiers_refusal: deepseek4's KV state, LongRoPE's factors) is refused with
  a typed error instead.
- cache-borrow: device prefill (CPU stand-in) whose buffers borrow the slots of the last cached layers,
  every expert slotted: two prompts (lent, evicted, refilled after each) with decode steps == stock
  logits bitwise; a model whose slots cannot hold the two buffers (one cached layer) is refused with a
  typed error instead.
"""
from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the helpers package

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"  # 12 tokens of the test vocabulary
N_GEN = 16
N_CTX = 128
# one thread: the models are tiny, and ggml's threads spin at their barriers, which on a busy machine
# (the parent runs two of these children at a time) costs far more than they compute
THREADS = 1
PLAIN = dict(n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_threads=THREADS,
             use_extra_bufts=False)  # as tests/helpers/cache_runs.py


def _tokens(n_vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(0, n_vocab, n)]


def _diff(got: np.ndarray, ref: np.ndarray) -> str:
    nmse = float(((got - ref) ** 2).mean() / max(float((ref ** 2).mean()), 1e-30))
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    return f"NMSE {nmse:.2e}, max |diff| {float(np.abs(got - ref).max()):.3g}, argmax agreement {agree:.3f}"


def check_generate(path: Path) -> dict:
    from edgemoe import GREEDY, Engine, LoadConfig

    from helpers.stock import stock_greedy

    prompt_ids, ref = stock_greedy(path, PROMPT, N_GEN, n_ctx=N_CTX, n_threads=THREADS)
    with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=THREADS)) as eng:
        g = eng.generate(PROMPT, max_tokens=N_GEN, sampling=GREEDY)
        ours_prompt = eng.tokenize(PROMPT)
    if ours_prompt != prompt_ids:
        return dict(ok=False, detail=f"prompt tokens differ: edgemoe {ours_prompt} vs stock {prompt_ids}")
    ok = g.tokens == ref
    first = next((i for i, (a, b) in enumerate(zip(g.tokens, ref, strict=False)) if a != b),
                 min(len(g.tokens), len(ref)))
    detail = (f"{len(ref)} greedy tokens equal" if ok
              else f"differ from token {first}: edgemoe {g.tokens} vs stock {ref}")
    return dict(ok=ok, detail=detail, tokens=g.tokens, stock=ref)


def check_gating_top1(path: Path) -> dict:
    from edgemoe import Engine, LoadConfig
    from edgemoe.analysis.verify import FnPolicy
    from edgemoe.policies.gating import GatingPolicy, GatingRule

    with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=THREADS)) as eng:
        toks = _tokens(eng.n_vocab, 40)
        k = eng.info.n_expert_used
    rules: set[str] = set()
    out = {}
    for where in ("graph", "hook"):
        policy = GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False)
        with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=THREADS)) as eng:
            if where == "graph":
                got_where = eng.set_gating(policy)
                if got_where != "graph":
                    return dict(ok=False, detail=f"set_gating ran gating in the {got_where}, not the graph")
            else:
                eng.set_policies([FnPolicy(lambda r: rules.add(r.weight_rule.name.lower()
                                                               + ("" if r.weight_scale == 1.0
                                                                  else f" x{r.weight_scale:g}"))),
                                  policy])
            out[where] = (np.stack(eng.eval_logits(toks)), eng.control_stats(), policy)
    with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=THREADS, expert_used_count=1)) as eng:
        top1 = np.stack(eng.eval_logits(toks))
    problems = []
    for where, (got, stats, policy) in out.items():
        if not np.array_equal(got, top1):
            problems.append(f"{where}: {_diff(got, top1)}")
        dropped, routed = ((stats["n_dropped"], stats["n_routed"]) if where == "graph"
                           else (policy.n_dropped, policy.n_routed))
        if routed == 0 or dropped * k != routed * (k - 1):
            problems.append(f"{where}: dropped {dropped} of {routed} routed slots, expected {k - 1} of {k}")
    weights = ", ".join(sorted(rules)) or "?"
    if problems:
        return dict(ok=False, weight_rule=weights,
                    detail=f"top-1 of k={k} vs stock k=1 (weights: {weights}): " + "; ".join(problems))
    return dict(ok=True, weight_rule=weights,
                detail=f"top-1 of k={k} in graph and hook == stock k=1 bitwise (weights: {weights})")


def _cache_run(path: Path, toks: list[int], n_decode: int, slots: int | None, policy: str = "lru",
               calibration: Path | None = None, degrade: float | None = None,
               **options: object) -> tuple[np.ndarray, dict | None]:
    """Logits of a prefill and n_decode single-token steps with the cache (slots None: none); `options`: the
    policy's (edgemoe.runtime.cache_config.policy_config)."""
    from edgemoe import Engine, LoadConfig
    from edgemoe.runtime.cache_config import CacheConfig, calibrated_config

    with Engine(path, LoadConfig(**PLAIN)) as eng:
        cfg = CacheConfig(slots or 0, policy=calibrated_config(policy, calibration, **options),
                          degrade=degrade)
        cache = eng.enable_expert_cache(cfg) if slots is not None else None
        rows = list(eng.eval_logits(toks[:-n_decode]))
        for tok in toks[-n_decode:]:
            eng.feed([tok])
            rows.append(np.array(eng.logits(-1)))
        stats = cache.stats() if cache is not None else None
        if cache is not None:
            stats["n_host_syncs"] = eng.control_stats()["n_host_syncs"]
            stats.update(eng.experts.report())  # the prefetcher's, the assigner's, the degradation's counters
    return np.stack(rows), stats


def check_cache(path: Path) -> dict:
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    ref, _ = _cache_run(path, toks, 12, None)
    problems, seen = [], []
    for slots in sorted({1, info.n_expert}):
        got, st = _cache_run(path, toks, 12, slots)
        assert st is not None
        used = f"hits {st['hits']}, loads {st['loads']}"
        seen.append(f"{slots} slot(s): {used}")
        if not np.array_equal(got, ref):
            bad = [i for i in range(len(ref)) if not np.array_equal(got[i], ref[i])]
            problems.append(f"{slots} slot(s): rows {bad[:4]}{'...' if len(bad) > 4 else ''} differ, "
                            + _diff(got, ref))
        elif st["hits"] == 0 or st["loads"] == 0:
            problems.append(f"{slots} slot(s): the cache was not used ({used})")
        elif st["n_host_syncs"]:
            problems.append(f"{slots} slot(s): {st['n_host_syncs']} host syncs (tables not in the graph)")
    if problems:
        return dict(ok=False, detail="lru cache vs stock: " + "; ".join(problems))
    return dict(ok=True, detail="lru cache == stock bitwise (" + "; ".join(seen) + ")")


def _calibrated_cache_check(path: Path, policy: str) -> dict:
    """`policy` (static, daop: router frequencies), calibrated on first use, half the experts per layer."""
    import os
    import tempfile

    from edgemoe.calibration.auto import STAGES_FOR, ensure_calibration
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    ref, _ = _cache_run(path, toks, 12, None)
    slots = max(1, info.n_expert // 2)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EDGEMOE_CACHE_DIR"] = tmp  # a first use: no calibration of this model anywhere
        cal = ensure_calibration(path, STAGES_FOR["static"], f"--policy {policy}", n_threads=THREADS, tokens=512,
                                 ctx=128, echo=lambda msg: None)
        got, st = _cache_run(path, toks, 12, slots, policy=policy, calibration=cal)
    assert st is not None
    used = f"{slots} slot(s): hits {st['hits']}, misses {st['misses']}, loads {st['loads']}"
    if not np.array_equal(got, ref):
        return dict(ok=False, detail=f"{policy} cache vs stock ({used}): " + _diff(got, ref))
    if st["hits"] == 0:
        return dict(ok=False, detail=f"{policy} cache not used ({used})")
    if st["n_host_syncs"]:
        return dict(ok=False, detail=f"{policy}: {st['n_host_syncs']} host syncs (not run natively; {used})")
    return dict(ok=True, detail=f"{policy} cache, calibrated on first use, == stock bitwise ({used})")


def check_cache_static(path: Path) -> dict:
    return _calibrated_cache_check(path, "static")


def check_cache_daop(path: Path) -> dict:
    return _calibrated_cache_check(path, "daop")


def check_cache_dali(path: Path) -> dict:
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    ref, _ = _cache_run(path, toks, 12, None)
    slots = max(1, info.n_expert // 2)
    got, st = _cache_run(path, toks, 12, slots, policy="dali", window=2)
    assert st is not None
    used = f"{slots} slot(s): hits {st['hits']}, misses {st['misses']}, loads {st['loads']}"
    if not np.array_equal(got, ref):
        return dict(ok=False, detail=f"dali cache vs stock ({used}): " + _diff(got, ref))
    if st["hits"] == 0 or st["loads"] == 0:
        return dict(ok=False, detail=f"dali cache not used ({used})")
    if st["n_host_syncs"]:
        return dict(ok=False, detail=f"dali: {st['n_host_syncs']} host syncs (not run natively; {used})")
    return dict(ok=True, detail=f"native dali cache == stock bitwise ({used})")


def check_scale_applies(path: Path) -> dict:
    """A weight-scale copy (tests/test_arch_sweep.py WSCALE_DIR) computes other logits than the file it
    copies, so the scale is read and applied."""
    sys.path.insert(0, str(ROOT / "tools"))
    from arch_models import DEFAULT_OUT

    from edgemoe.gguf.info import read_model_info

    base = DEFAULT_OUT / path.name
    toks = _tokens(read_model_info(path).n_vocab, 16)
    got, ref = (_cache_run(p, toks, 4, None)[0] for p in (path, base))
    if np.array_equal(got, ref):
        return dict(ok=False, detail=f"the same logits as {base.name}: the weight scale/norm is not read")
    return dict(ok=True, detail="logits differ from the unscaled file's: " + _diff(got, ref))


def _hook_check(path: Path, name: str, acted: Callable[[dict, Any], str | None], **config: object) -> dict:
    """A cache policy in the routing hook, one slot per layer, == stock logits bitwise, and `acted(stats, info)`
    (None, or why the policy did not act). Run on the .k1 copies: the hook's cache split keeps the slot ids
    beside the routed ids in the top-k's row, so it needs 2k <= n_expert (with more, the layer runs without its
    cache: equal to stock, but nothing to check)."""
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    ref, _ = _cache_run(path, toks, 12, None)
    got, st = _cache_run(path, toks, 12, 1, **config)
    assert st is not None
    seen = f"hits {st['hits']}, misses {st['misses']}, " + ", ".join(
        f"{k} {st[k]}" for k in ("prefetch", "assign", "degrade") if k in st)
    if not np.array_equal(got, ref):
        return dict(ok=False, detail=f"{name} cache vs stock ({seen}): " + _diff(got, ref))
    if st["hits"] + st["misses"] == 0:
        return dict(ok=False, detail=f"{name}: the cache was not used ({seen})")
    why = acted(st, info)
    if why:
        return dict(ok=False, detail=f"{name}: {why} ({seen})")
    return dict(ok=True, detail=f"{name} cache == stock bitwise ({seen})")


def _prefetched(st: dict, info: Any) -> str | None:
    """Prefetches issued where there is a layer ahead."""
    return "no prefetch issued" if len(info.moe_layers) > 1 and not st["prefetch"]["issued"] else None


def check_cache_promoe(path: Path) -> dict:
    """ProMoE's prefetcher (no calibration: gate reuse one layer ahead) inside llama.cpp: the
    in-graph predictor's ids drive the loads."""
    def acted(st: dict, info: Any) -> str | None:
        return _prefetched(st, info) or (None if st["prefetch"].get("path") == "native" else "ran in the hook")

    return _hook_check(path, "promoe", acted, policy="promoe", distance=1)


def check_cache_dali_prefetch(path: Path) -> dict:
    """dali with its residual-based prefetcher, prefetch size 1, a window of 2 tokens."""
    return _hook_check(path, "dali-prefetch", _prefetched, policy="dali", prefetch=1, window=2)


def check_cache_assign(path: Path) -> dict:
    """lru with the ratio assigner (--assign) priced by a bundled GPU profile for this model's shapes: some
    routes' loads are weighed (and made before their layer, or not), the logits stock's."""
    from edgemoe.perf.model.costmodel import ModelShape, expert_costs
    from edgemoe.perf.model.profile import load_profile

    costs = expert_costs(ModelShape.read(path), load_profile("rtx4060-laptop"))
    return _hook_check(path, "assign", lambda st, info: None if st["assign"]["routes"] else "no route weighed",
                       policy="lru", assign="ratio", assign_costs=costs)


def check_cache_degrade(path: Path) -> dict:
    """DAOP's graceful degradation at r = 1 (a resident expert replaces a CPU one only on an exact tie of their
    router scores): it reads every decode route's router probabilities and changes nothing."""
    return _hook_check(path, "degrade", lambda st, info: None if st["degrade"]["routed"] else "no route read",
                       policy="lru", degrade=1.0)


def _precalc_run(path: Path, toks: list[int], n_decode: int, resident: int) -> tuple[np.ndarray, dict]:
    """Logits of a prefill and n_decode single-token steps with a manual cache whose first `resident` experts of
    every MoE layer are loaded, pre-calculating from layer 1 on, and the pre-calculation's counters."""
    from edgemoe import Engine, LoadConfig
    from edgemoe.policies.loads import Load
    from edgemoe.runtime.cache_config import CacheConfig, ManualConfig

    with Engine(path, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(max(resident, 1), policy=ManualConfig(), precalc_from=1))
        assert cache is not None
        for il in eng.info.moe_layers:
            for e in range(resident):
                cache.load(Load(il, e, e))
        rows = list(eng.eval_logits(toks[:-n_decode]))
        for tok in toks[-n_decode:]:
            eng.feed([tok])
            rows.append(np.array(eng.logits(-1)))
        st = cache.precalc_stats()
    assert st is not None
    return np.stack(rows), st


def check_cache_precalc(path: Path) -> dict:
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    n_decode = 12
    ref, _ = _cache_run(path, toks, n_decode, None)
    got, st = _precalc_run(path, toks, n_decode, 0)
    moe = set(info.moe_layers)
    targets = [il for il in sorted(moe) if il >= 1 and il - 1 in moe]
    counts = f"layers {st['layers']}, computed {st['computed']}, used {st['used']}, late {st['late']}"
    problems = []
    n_prompt = len(toks) - n_decode
    if not np.array_equal(got[:n_prompt], ref[:n_prompt]):
        problems.append("prompt rows differ from stock: " + _diff(got[:n_prompt], ref[:n_prompt]))
    if not np.isfinite(got).all():
        problems.append("non-finite logits")
    if st["layers"] != n_decode * len(targets):
        problems.append(f"{st['layers']} layer runs took experts early, expected {n_decode} x {len(targets)} "
                        f"(MoE layers after a MoE layer: {targets})")
    if targets and not (0 < st["used"] <= st["computed"]):
        problems.append("no expert taken early")
    if info.n_expert_used == info.n_expert and st["late"]:
        problems.append("an expert ran late though the prediction names every expert")
    every, st_every = _precalc_run(path, toks, n_decode, info.n_expert)
    if not np.array_equal(every, ref) or st_every["computed"]:
        problems.append(f"every expert resident: computed {st_every['computed']}, " + _diff(every, ref))
    if problems:
        return dict(ok=False, detail=f"pre-calculation ({counts}): " + "; ".join(problems))
    return dict(ok=True, detail=f"pre-calculation from layer 1: prompt == stock, {counts}; every expert resident "
                                "== stock bitwise")


def check_speculate(path: Path) -> dict:
    from edgemoe import GREEDY, Engine, LoadConfig
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig
    from edgemoe.speculation import SpeculationConfig

    sources = (SpeculationConfig(mode="lookup", draft_max=4, ngram_min=1),
               SpeculationConfig(mode="draft", draft_max=3, draft_model=str(path)))
    with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=THREADS)) as eng:
        want = eng.generate(PROMPT, max_tokens=N_GEN, sampling=GREEDY).tokens
        eng.enable_expert_cache(CacheConfig(1, policy=LruConfig()))
        problems, seen = [], []
        for cfg in sources:
            eng.set_speculation(cfg)
            eng.reset()
            g = eng.generate(PROMPT, max_tokens=N_GEN, sampling=GREEDY)
            st = g.speculation
            assert st is not None
            seen.append(f"{cfg.mode}: {st.steps} steps, {st.accepted}/{st.drafted} accepted")
            if g.tokens != want:
                first = next(i for i, (a, b) in enumerate(zip(g.tokens, want, strict=False)) if a != b)
                problems.append(f"{cfg.mode} differs from token {first} (smallest top-2 gap {st.min_top2_gap})")
        eng.set_speculation(None)
    if problems:
        return dict(ok=False, detail="speculation vs one token per decode: " + "; ".join(problems))
    return dict(ok=True, detail="speculation with the lru cache == one token per decode (" + "; ".join(seen) + ")")


def _borrow_session(path: Path, toks: list[int], n_decode: int, borrow: bool | None) -> tuple[np.ndarray, dict | None]:
    """Two prompts (each a fresh sequence) and their decode steps; borrow None: no cache, else the lru cache
    with every expert slotted and device prefill from 8 tokens, borrowing the slots or not."""
    from edgemoe import Engine, LoadConfig
    from edgemoe.gguf.info import read_model_info
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig

    info = read_model_info(path)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        cache = None
        if borrow is not None:
            cache = eng.enable_expert_cache(CacheConfig(info.n_expert, policy=LruConfig(), prefill_min_tokens=8,
                                                        prefill_borrow=borrow))
        rows: list[np.ndarray] = []
        for _ in range(2):
            rows += list(eng.eval_logits(toks[:-n_decode]))
            for tok in toks[-n_decode:]:
                eng.feed([tok])
                rows.append(np.array(eng.logits(-1)))
        return np.stack(rows), (cache.prefill_stats() if cache is not None else None)


def check_cache_borrow(path: Path) -> dict:
    from edgemoe.gguf.info import read_model_info
    from edgemoe.runtime.expert_cache import ExpertCacheError

    info = read_model_info(path)
    toks = _tokens(info.n_vocab, 48)
    ref, _ = _borrow_session(path, toks, 12, None)
    try:
        got, st = _borrow_session(path, toks, 12, True)
    except ExpertCacheError as err:
        if len(info.moe_layers) < 2 and "prefill_borrow" in str(err):
            return dict(ok=True, detail=f"refused with {len(info.moe_layers)} cached layer: {err}"[:300])
        raise
    b = (st or {}).get("borrow") or {}
    used = ", ".join(f"{k} {b.get(k)}" for k in ("lent_layers", "lends", "evicted", "refilled", "refused"))
    if not np.array_equal(got, ref):
        return dict(ok=False, detail=f"borrowing slots vs stock ({used}): " + _diff(got, ref))
    if b.get("lends") != 2 or not b.get("refilled") or not b.get("evicted"):
        return dict(ok=False, detail=f"the slots were not lent and refilled twice ({used})")
    return dict(ok=True, detail=f"borrowing slots == stock bitwise ({used})")


def _tiers_walk(path: Path, toks: list[int], tiers: bool) -> tuple[np.ndarray, list[list[int]]]:
    """The context filled across its steps (a prompt in the first, one past it, decode steps into the last), a
    snapshot restored after a new prompt sent the context back to its smallest step; tiers False: stock."""
    from edgemoe import Engine, LoadConfig
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig
    from edgemoe.runtime.context_tiers import ContextTier, ContextTiers

    with Engine(path, LoadConfig(**{**PLAIN, "n_ctx": 512})) as eng:
        if tiers:
            n = eng.info.n_expert
            eng.enable_expert_cache(CacheConfig(1, policy=LruConfig()))
            eng.set_context_tiers(ContextTiers((ContextTier(256, max(1, n // 2)), ContextTier(512, 1))))
        rows: list[np.ndarray] = []
        for chunk in (toks[:200], toks[200:300], *([t] for t in toks[300:304])):
            eng.feed(chunk)
            rows.append(np.array(eng.logits(-1)))
        snap = eng.snapshot()
        eng.prefill(toks[400:440])  # shares nothing with the sequence
        rows.append(np.array(eng.logits(-1)))
        eng.restore(snap)
        eng.feed(toks[304:310])
        rows.append(np.array(eng.logits(-1)))
        steps = [[r.from_ctx, r.to_ctx] for r in eng.tiers.resizes] if eng.tiers is not None else []
        return np.stack(rows), steps


def check_context_tiers(path: Path) -> dict:
    from edgemoe.errors import InvalidConfigError
    from edgemoe.gguf.header import check_gguf
    from edgemoe.gguf.info import read_model_info
    from edgemoe.runtime.context_tiers import tiers_refusal

    toks = _tokens(read_model_info(path).n_vocab, 440)
    ref, _ = _tiers_walk(path, toks, False)
    try:
        got, steps = _tiers_walk(path, toks, True)
    except InvalidConfigError as err:
        if tiers_refusal(check_gguf(path)) is not None and "context tiers would change" in str(err):
            return dict(ok=True, detail=f"refused: {err}"[:300])
        raise
    if not np.array_equal(got, ref):
        return dict(ok=False, detail=f"context tiers (steps {steps}) vs stock: " + _diff(got, ref))
    if steps[:2] != [[512, 256], [256, 512]] or [256, 512] not in steps[3:]:
        return dict(ok=False, detail=f"the context did not step 512 -> 256 -> 512, back and up again: {steps}")
    return dict(ok=True, detail=f"context tiers == stock bitwise (steps {steps})")


CHECKS = {"generate": check_generate, "speculate": check_speculate, "gating-top1": check_gating_top1, "cache": check_cache,
          "cache-static": check_cache_static, "cache-daop": check_cache_daop, "cache-dali": check_cache_dali,
          "scale-applies": check_scale_applies, "cache-promoe": check_cache_promoe,
          "cache-dali-prefetch": check_cache_dali_prefetch, "cache-assign": check_cache_assign,
          "cache-degrade": check_cache_degrade, "cache-precalc": check_cache_precalc,
          "cache-borrow": check_cache_borrow, "context-tiers": check_context_tiers}


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    for name in argv[1:]:
        try:
            res = CHECKS[name](path)
        except Exception as err:  # noqa: BLE001 - reported as this check's failure
            tb = traceback.format_exc().strip().splitlines()
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [""]
            # a message that ends in llama.cpp's log tail: its first clause and the log's last line
            msg = lines[0] if len(lines) == 1 else f"{lines[0].split(':')[0]}: ... {lines[-1]}"
            res = dict(ok=False, detail=f"{type(err).__name__}: {msg}"[:600], where=tb[-3:])
        print("@@ " + json.dumps(dict(check=name, **res)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
