"""Run by tests/test_context_tiers.py in a process of its own: context tiers with the expert cache on llama.cpp's RPC
backend (a registered RPC device is seen by every model loaded afterwards in the process).

The walk of tiers_walk.walk_steps (the context filled from empty across every step, a truncation, a new prompt, a
restored snapshot) on stock and on a cached engine whose context is re-created at each step: with the cache on the
device (the CPU stand-in's layout) and in the CLI's GPU layout (every layer and the KV cache on the device, the
routed experts in CPU memory). Writes one JSON object to the file named by argv[2].
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
from dataclasses import replace

import numpy as np

from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

from helpers.child_result import write_and_exit
from helpers.tiers_walk import CFG, tiers_for, walk_steps


def walk(path: Path, cfg: LoadConfig, ids: list[int], device: object | None) -> tuple[list[np.ndarray], dict]:
    with Engine(path, cfg) as eng:
        info: dict[str, object] = {}
        if device is not None:
            n_expert = eng.info.n_expert
            eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=LruConfig()), device=device)
            eng.set_ids_check(True)
            resizer = eng.set_context_tiers(tiers_for(n_expert))
            assert resizer is not None
        out = walk_steps(eng, ids)
        if device is not None:
            assert eng.tiers is not None and eng.experts is not None
            info = {"resizes": [[r.from_ctx, r.to_ctx, r.tokens] for r in eng.tiers.resizes],
                    "stats": eng.experts.stats(), "ids_check": eng.ids_check()}
    return out, info


def short_hit_rate(path: Path, device: object, tiers: bool) -> float | None:
    """The decode hit rate of a short conversation (a 100-token prompt, 48 tokens generated: the first step), the
    LRU cache at the whole context's slots, with tiers at the first step's."""
    with Engine(path, CFG) as eng:
        n_expert = eng.info.n_expert
        eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=LruConfig()), device=device)
        if tiers:
            eng.set_context_tiers(tiers_for(n_expert))
        prompt = [int(x) for x in np.random.default_rng(2).integers(10, eng.n_vocab - 10, 100)]
        eng.generate(prompt, max_tokens=48, sampling=GREEDY, ignore_eog=True)
        assert eng.experts is not None
        return eng.experts.stats()["decode_hit_rate"]


def main(path: Path) -> dict[str, object]:
    with Engine(path, CFG) as eng:
        rng = np.random.default_rng(1)
        ids = [int(x) for x in rng.integers(10, eng.n_vocab - 10, 1100)]
        layers = tuple(eng.info.moe_layers)
    ref, _ = walk(path, CFG, ids, None)  # stock, before the RPC device exists
    dev = native.rpc_loopback_device()
    out: dict[str, object] = {"device": native.device_name(dev)}
    got, info = walk(path, CFG, ids, dev)
    out["standin_equal"] = all(np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
    out["standin"] = info
    out["short_hit_rate"] = {"tiers": short_hit_rate(path, dev, True), "whole": short_hit_rate(path, dev, False)}
    gpu = replace(CFG, n_gpu_layers=999, cpu_expert_layers=layers, op_offload=False)
    stock_gpu, _ = walk(path, gpu, ids, None)
    got, info = walk(path, gpu, ids, dev)
    out["gpu_layout_equal"] = all(np.array_equal(a, b) for a, b in zip(got, stock_gpu, strict=True))
    out["gpu_layout"] = info
    return out


if __name__ == "__main__":
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])), default=str)
