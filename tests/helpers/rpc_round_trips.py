"""Run by tests/test_device_ids.py in a process of its own: the host round trips each decoded token costs on the RPC
device with the lru cache on half the experts, counted from the RPC server's own log (GGML_RPC_DEBUG): blocking
reads (get_tensor), small writes (set_tensor of up to 4 KiB: ids, masks, inputs; the experts' loads are counted
apart) and graph computes. The mode is the environment's (EDGEMOE_DEVICE_IDS).

argv: MODEL OUT.json. Writes {"n_moe_layers", "tokens", "per_token": {kind: count per decoded token}}.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["GGML_RPC_DEBUG"] = "1"  # before the library reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # the CPU kernels' setting for runs on the RPC device

# isort: split
import re
from collections import Counter

import numpy as np

from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.child_result import write_and_exit

CFG = LoadConfig(n_ctx=128, n_batch=32, n_ubatch=32, n_threads=2, use_extra_bufts=False, op_offload=False)
N_DECODE = 8
SMALL = 4096  # bytes: a write of ids, a mask or a layer's input; an expert's load is larger
_CMD = re.compile(r"\s*\[(get_tensor|set_tensor|graph_compute|copy_tensor)\](?:.*?size: (\d+))?")


def count(lines: list[str]) -> Counter[str]:
    c: Counter[str] = Counter()
    for line in lines:
        m = _CMD.match(line)
        if m is None:
            continue
        kind = m.group(1)
        if kind == "set_tensor" and m.group(2) is not None and int(m.group(2)) > SMALL:
            kind = "load"
        c[kind] += 1
    return c


def main(path: Path) -> dict[str, object]:
    dev = native.rpc_loopback_device()
    with Engine(path, CFG) as eng:
        eng.enable_expert_cache(CacheConfig(max(1, eng.info.n_expert // 2), policy=LruConfig()), device=dev)
        toks = [int(t) for t in np.random.default_rng(0).integers(1, min(eng.n_vocab, 200), 24)]
        eng.eval_logits(toks[:-N_DECODE])
        with native.captured_log() as lines:
            for tok in toks[-N_DECODE:]:
                eng.feed([tok])
        c = count(lines)
        n_moe = len(eng.info.moe_layers)
    return {"n_moe_layers": n_moe, "tokens": N_DECODE, "per_token": {k: v / N_DECODE for k, v in sorted(c.items())}}


if __name__ == "__main__":
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])))
