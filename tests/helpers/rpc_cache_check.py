"""Run by tests/test_cache_rpc.py in a process of its own: the expert cache on llama.cpp's RPC backend.

The RPC server runs in this process on loopback and serves the CPU backend, so the cache device is a
real separate device (its own buffers, a scheduler split of its own, cross-device copies of the ids
and activations, a loader connection with async copies and events) and the arithmetic is still the
CPU's: results must equal stock bitwise. Writes one JSON object to the file named by argv[2].
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
import time
from dataclasses import replace

import numpy as np

from edgemoe.policies.residency import Load
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig, PromoeConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY
from edgemoe.speculation import SpeculationConfig

from helpers.child_result import write_and_exit

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
CFG = LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, use_extra_bufts=False, op_offload=False)


# EDGEMOE_CHECK_IDS=1 (every Engine checks the id rows it hands a device): each closed engine's counts, summed in main
_ID_CHECKS: list[dict[str, int | str]] = []
_engine_close = Engine.close


def _close_counting(self: Engine) -> None:
    if self.handle.is_open:
        _ID_CHECKS.append(self.ids_check())
    _engine_close(self)


Engine.close = _close_counting  # type: ignore[method-assign]


def id_checks() -> dict[str, object]:
    """The checker's counts over every engine of this run, with the first failing row of any."""
    total: dict[str, object] = {k: sum(int(c[k]) for c in _ID_CHECKS) for k in
                                ("n_nodes", "n_rows", "n_negative", "n_range", "n_repeat")}
    total["first"] = next((c["first"] for c in _ID_CHECKS if c["first"]), "")
    return total

def run(eng: Engine, toks: list[int], between: object = None) -> tuple[np.ndarray, list[np.ndarray]]:
    pre = np.array(eng.eval_logits(toks[:-8]))
    steps = []
    for tok in toks[-8:]:
        if between is not None:
            between()  # type: ignore[operator]
        eng.feed([tok])
        steps.append(np.array(eng.logits(-1)))
    return pre, steps


def same(a: tuple[np.ndarray, list[np.ndarray]], b: tuple[np.ndarray, list[np.ndarray]]) -> bool:
    return bool(np.array_equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=False)))


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    return float(((got - ref) ** 2).mean() / (ref ** 2).mean())


def main(path: Path) -> dict[str, object]:
    with Engine(path, CFG) as eng:  # stock, before the RPC device exists
        toks = eng.tokenize(TEXT)[:56]
        ref = run(eng, toks)
        n_expert, layers = eng.info.n_expert, list(eng.info.moe_layers)
    # a fresh context, as the cached engine's below: after run() the prompt would reuse a KV prefix and be split
    # into other ubatches, and greedy tokens can differ by that alone (they did with the sanitizer build's -O1)
    with Engine(path, CFG) as eng:
        ref_gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens

    dev = native.rpc_loopback_device()
    out: dict[str, object] = {"device": native.device_name(dev), "n_moe_layers": len(layers)}
    rng = np.random.default_rng(0)

    with Engine(path, CFG) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=ManualConfig()), device=dev)

        def shuffle() -> None:
            for il in layers:
                for slot in range(n_expert // 2):
                    cache.load(Load(il, int(rng.integers(-1, n_expert)), slot))

        shuffle()
        out["sync_loads_equal"] = same(run(eng, toks, shuffle), ref)
        out["sync_stats"] = cache.stats()

        def prefetch_some() -> None:  # async loads over the loader connection, often left half issued
            for il in layers:
                absent = [e for e in range(n_expert) if cache.state(il, e) == "absent"]
                if absent:
                    cache.prefetch(Load(il, int(rng.choice(absent)), int(rng.integers(n_expert // 2))))
            cache.issue(int(rng.integers(0, 4)))

        cache.reset_stats()
        out["async_loads_equal"] = same(run(eng, toks, prefetch_some), ref)
        cache.sync()
        out["async_stats"] = cache.stats()

    with Engine(path, CFG) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig()), device=dev)
        gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        out["lru_generate_equal"] = gen == ref_gen
        out["lru_stats"] = cache.stats()
        # speculative decoding: verification batches of several positions through the cache on the device
        eng.set_speculation(SpeculationConfig(mode="lookup", draft_max=4, ngram_min=1))
        eng.reset()
        g = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True)
        out["lookup_generate_equal"] = g.tokens == ref_gen
        out["lookup_stats"] = g.speculation.to_dict() if g.speculation is not None else None

    # the CLI's GPU layout: every layer offloaded (-ngl 999) to the device, routed experts kept in CPU
    # memory by tensor overrides (-ot exps=CPU), the cache on the device
    gpu_layout = replace(CFG, n_gpu_layers=999, cpu_expert_layers=tuple(layers))
    with Engine(path, gpu_layout) as eng:
        stock_layout = run(eng, toks)
    with Engine(path, gpu_layout) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig()), device=dev)
        got = run(eng, toks)
        out["gpu_layout_stats"] = cache.stats()
    out["gpu_layout_equal"] = same(got, stock_layout)
    out["gpu_layout_nmse_vs_cpu"] = nmse(got[0], ref[0])

    # overlap: the cached experts run on the device while the CPU computes the others, in both layouts
    for name, cfg, want in (("standin", CFG, ref), ("gpu_layout", gpu_layout, stock_layout)):
        for overlap in (True, False):
            with Engine(path, cfg) as eng:
                eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig(),
                                                    overlap=overlap), device=dev)
                eng.reset_control_stats()
                got = run(eng, toks)
                out[f"overlap_{name}_{overlap}"] = {"equal": same(got, want), **eng.control_stats()}

    # the load worker (policies on the load worker): llama.cpp's worker thread issues the chunks, runs the native LRU on
    # the routes that arrived while the caller is away (here: a pause between tokens) and times the compute's
    # waits for loads
    for async_loads in (True, False):
        with Engine(path, gpu_layout) as eng:
            cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig(),
                                                        async_loads=async_loads),
                                            device=dev)
            eng.reset_control_stats()
            got = run(eng, toks, lambda: time.sleep(0.02))
            stats = cache.stats()
            for _ in range(500):  # the worker times the last ubatch's waits after the caller has read its logits
                if stats["load_waits_timed"] == stats["load_waits"]:
                    break
                time.sleep(0.01)
                stats = cache.stats()
            out[f"worker_{async_loads}"] = {"equal": same(got, stock_layout), **stats,
                                            "n_host_syncs": eng.control_stats()["n_host_syncs"]}

    # staging buffers: none by default on RPC (no host buffer type); forced into plain host memory,
    # every chunk goes through one, with one buffer (each send waited for before the next copy) and with four
    for n_staging in (0, 1, 4):
        with Engine(path, gpu_layout) as eng:
            cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig(),
                                                        async_loads=True), device=dev)
            if n_staging:
                assert native.moe_cache_set_staging(eng.handle.ctx, n_staging, True) == 0
            got = run(eng, toks)
            out[f"staging_{n_staging}"] = {"equal": same(got, stock_layout), **cache.stats()}

    # the caller's cache calls racing the worker: random loads, prefetches (some into slots being copied),
    # partial issues and state queries between tokens; afterwards every load is resident or gone
    with Engine(path, gpu_layout) as eng:
        cache = eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=ManualConfig(),
                                                    async_loads=True), device=dev)
        assert native.moe_cache_set_staging(eng.handle.ctx, 2, True) == 0  # two staging buffers, reused all the time

        def churn() -> None:
            for il in layers:
                # a second load into the same slot preempts the first, which the worker may be copying
                e1, e2 = rng.choice(n_expert, 2, replace=False)
                cache.prefetch(Load(il, int(e1), 0))
                cache.prefetch(Load(il, int(e2), 0))
                for _ in range(3):
                    e, slot = int(rng.integers(n_expert)), int(rng.integers(n_expert // 2))
                    op = int(rng.integers(4))
                    if op == 0:
                        cache.load(Load(il, e, slot))
                    elif op == 1:
                        cache.prefetch(Load(il, e, slot), int(rng.integers(0, 3)))
                    elif op == 2:
                        cache.issue(int(rng.integers(0, 3)))
                    else:
                        cache.state(il, e)

        got = run(eng, toks, churn)
        cache.sync()
        states = {cache.state(il, e) for il in layers for e in range(n_expert)}
        out["worker_churn"] = {"equal": same(got, stock_layout), "states": sorted(states), **cache.stats()}

    # promoe inside llama.cpp (predicted prefetch) on the device: the in-graph predictor's ids queue loads at each cached
    # layer's routing callback, issued by the caller or by the load worker while the later layers compute
    from edgemoe.calibration.adaptive import default_calibration_dir

    cal = default_calibration_dir(path)
    for async_loads in (True, False):
        with Engine(path, gpu_layout) as eng:
            eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=PromoeConfig(calibration=cal),
                                                async_loads=async_loads), device=dev)
            eng.reset_control_stats()
            got = run(eng, toks)
            native.moe_cache_sync(eng.handle.ctx)
            ctl = eng.control_stats()
            out[f"promoe_worker_{async_loads}"] = {"equal": same(got, stock_layout), **eng.experts.stats(),
                                                   "prefetch": eng.experts.report()["prefetch"],
                                                   "hook": eng.routing.hooks is not None,
                                                   "n_host_syncs": ctl["n_host_syncs"], "n_overlap": ctl["n_overlap"],
                                                   "n_ubatch": ctl["n_ubatch"]}
    # the scheduler overlap: with the callback's stops, the device's experts still overlap the CPU's; off: none
    with Engine(path, gpu_layout) as eng:
        eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=PromoeConfig(calibration=cal),
                                            overlap=False), device=dev)
        eng.reset_control_stats()
        got = run(eng, toks)
        out["promoe_no_overlap"] = {"equal": same(got, stock_layout), **eng.control_stats()}

    # prefill on the device: the prompt's ubatch runs each cached layer's other experts on the device
    # from the two prefill buffers, copied one cached layer ahead (all, or nothing ahead), by the worker or the caller
    for ahead, async_loads in (("all", True), ("all", False), ("routed", True)):
        with Engine(path, gpu_layout) as eng:
            cache = eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=LruConfig(),
                                                        async_loads=async_loads, prefill_min_tokens=8,
                                                        prefill_ahead=ahead), device=dev)
            eng.reset_control_stats()
            got = run(eng, toks)
            out[f"prefill_{ahead}_{async_loads}"] = {"equal": same(got, stock_layout), **eng.control_stats(),
                                                     **cache.stats(), "prefill": cache.prefill_stats()}
    with Engine(path, gpu_layout) as eng:  # promoe's predictor names what copies ahead
        eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=PromoeConfig(calibration=cal),
                                            prefill_min_tokens=8, prefill_ahead="predicted"), device=dev)
        got = run(eng, toks)
        out["prefill_promoe_predicted"] = {"equal": same(got, stock_layout),
                                           "prefill": eng.experts.prefill_stats()}

    # DAOP's pre-calculation with the cache on the device: its tables and the predicted ids come from
    # the device, the early experts and the two ops run on the CPU; the CPU stand-in's logits and counters
    def precalc(layout: LoadConfig, device: object, first: int | None) -> tuple[tuple[np.ndarray, list[np.ndarray]], dict]:
        with Engine(path, layout) as eng:
            cache = eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=ManualConfig(),
                                                        precalc_from=first),
                                            device=device)
            for il in layers:
                for e in range(n_expert // 4):
                    cache.load(Load(il, e, e))
            eng.reset_control_stats()
            got = run(eng, toks)
            return got, {**(cache.precalc_stats() or {}), "n_overlap": eng.control_stats()["n_overlap"]}

    (a, st_a), (b, st_b) = precalc(CFG, None, 2), precalc(gpu_layout, dev, 2)
    _, st_off = precalc(gpu_layout, dev, None)
    out["precalc"] = {"equal": same(a, b), "nmse": max(nmse(x, y) for x, y in zip([a[0], *a[1]], [b[0], *b[1]], strict=False)),
                      "stats_standin": st_a, "stats_device": st_b, "n_overlap_without": st_off["n_overlap"]}

    # adaptive top-k in the graph with the overlapped cache: the gated logits of the same layout without a cache
    from edgemoe.policies.gating import GatingPolicy, GatingRule

    gated = []
    for cache_on in (False, True):
        with Engine(path, gpu_layout) as eng:
            if cache_on:
                eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig()), device=dev)
            eng.set_gating(GatingPolicy(GatingRule.SER, 0.4))
            eng.reset_control_stats()
            gated.append((run(eng, toks), eng.control_stats()))
    out["gated_overlap_equal"] = same(gated[0][0], gated[1][0])
    out["gated_overlap_stats"] = gated[1][1]

    # edgemoe bench's device configurations (numbers over loopback TCP mean nothing: the code paths run)
    from edgemoe.gguf.info import read_model_info
    from edgemoe.perf.bench.rows import BenchSpec
    from edgemoe.perf.bench.run import run_bench
    from edgemoe.plan.budget import estimate_kv_cache_bytes
    from edgemoe.plan.reserve import VRAM_RESERVE

    info = read_model_info(path)
    budget = (info.dense_bytes + estimate_kv_cache_bytes(info, 256) + VRAM_RESERVE
              + 3 * info.bytes_per_expert_by_layer[layers[0]] * n_expert)  # about 3 layers of experts
    res = run_bench(path, BenchSpec(vram=budget, prompt_tokens=32, gen_tokens=4, threads=2, policies=("lru",),
                                    compare_overlap=True))
    out["bench_rows"] = [(r.name, r.decode_tps > 0, r.note) for r in res.rows]
    out["bench_n_cpu_moe"] = res.n_cpu_moe
    out["ids_check"] = id_checks()
    return out


if __name__ == "__main__":
    # to a file: the RPC server thread prints connection messages to stdout at any time
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])))
