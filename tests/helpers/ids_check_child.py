"""Run by tests/test_ids_check.py in a process of its own (a registered RPC device is seen by every model loaded
afterwards): one scenario on a fixture with the RPC device standing in for a GPU and the id-row checker on.

argv: MODEL SCENARIO OUT.json. Writes {"check": the checker's counts, "nmse": the logits against the same run on the
CPU, "equal": bitwise equal to it, "device_ids": the device's id-row mode and where it came from}. The mode is the
environment's (EDGEMOE_DEVICE_IDS, LLAMA_MOE_DEVICE_IDS_DUMMY). Scenarios:
- cache: the lru cache on the device (half the experts), the prompt in one ubatch, then four decode steps;
- prefill: the same with the prompt's other experts run from the device's prefill buffers;
- gating: every layer and its experts on the device, adaptive top-k in the graph on every ubatch;
- hook-drop: every layer on the device, a routing hook that drops the last expert of every other token.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
from dataclasses import replace

import numpy as np

from edgemoe.analysis.verify import FnPolicy
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime import device_ids, native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.child_result import write_and_exit

CFG = LoadConfig(n_ctx=128, n_batch=32, n_ubatch=32, n_threads=2, use_extra_bufts=False, op_offload=False)
ON_DEVICE = replace(CFG, n_gpu_layers=999)


def run(eng: Engine, toks: list[int]) -> np.ndarray:
    rows = [np.array(eng.eval_logits(toks[:-4]))]
    for tok in toks[-4:]:
        eng.feed([tok])
        rows.append(np.array(eng.logits(-1))[None, :])
    return np.concatenate(rows)


def drop_last(r: RouteRecord) -> None:
    r.ids[::2, -1] = -1


def setup(eng: Engine, scenario: str, dev: object | None) -> None:
    n_expert = eng.info.n_expert
    if scenario in ("cache", "prefill") and dev is not None:
        prefill = 8 if scenario == "prefill" else 0
        eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig(), prefill_min_tokens=prefill),
                                device=dev)
    elif scenario == "gating":
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.9, decode_only=False))
    elif scenario == "hook-drop":
        eng.set_policies([FnPolicy(drop_last)])


def main(path: Path, scenario: str) -> dict[str, object]:
    layout = CFG if scenario in ("cache", "prefill") else ON_DEVICE
    with Engine(path, CFG) as eng:  # on the CPU, before the RPC device exists
        toks = [int(t) for t in np.random.default_rng(0).integers(1, min(eng.n_vocab, 200), 24)]
        setup(eng, scenario, None)
        ref = run(eng, toks)
    dev = native.rpc_loopback_device()
    with Engine(path, layout) as eng:
        eng.set_ids_check(True)
        setup(eng, scenario, dev)
        got = run(eng, toks)
        check = eng.ids_check()
        modes = device_ids.as_dicts(eng.device_ids)
    nmse = float(((got - ref) ** 2).mean() / (ref**2).mean())
    return {"check": check, "nmse": nmse, "equal": bool(np.array_equal(got, ref)), "device_ids": modes}


if __name__ == "__main__":
    write_and_exit(sys.argv[3], main(Path(sys.argv[1]), sys.argv[2]))
