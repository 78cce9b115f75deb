"""Run by tests/test_cache_rpc.py in a process of its own: device prefill whose buffers borrow the slots, with the
cache on llama.cpp's RPC device (rpc_cache_check.py says why a process of its own and why bitwise).

For ubatches of 512, 1024 and 2048 tokens: stock logits of borrow_session.session (a prompt of several
ubatches, decode steps, a second prompt after cutting the KV cache, a restored snapshot) in the CLI's GPU layout,
then the same session with the lru cache on the device and borrowing on (the load worker on at 1024 tokens, off
otherwise), and once more with the id-row checker on (every id row a device reads valid and distinct: the lent
layers' slots are not read while they hold a buffer's bytes). Writes {str(n_ubatch): result} to argv[2].
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
from dataclasses import replace

import numpy as np

from edgemoe.gguf.info import read_model_info
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine

from helpers.borrow_session import MIN_TOKENS, load_config, session
from helpers.child_result import write_and_exit


def check(path: Path, dev: object, n_ubatch: int) -> dict[str, object]:
    info = read_model_info(path)
    layout = replace(load_config(n_ubatch), n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers),
                     op_offload=False)
    with Engine(path, layout) as eng:
        ref = session(eng, n_ubatch)
    cfg = CacheConfig(max(1, info.n_expert // 2), policy=LruConfig(), prefill_min_tokens=MIN_TOKENS,
                      prefill_borrow=True, async_loads=n_ubatch == 1024)
    res: dict[str, object] = {}
    for checked in (False, True):
        with Engine(path, layout) as eng:
            eng.set_ids_check(checked)
            cache = eng.enable_expert_cache(cfg, device=dev)
            got = session(eng, n_ubatch)
            tag = "checked" if checked else "plain"
            res[f"equal_{tag}"] = len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref, strict=False))
            if checked:
                res["ids_check"] = eng.ids_check()
            else:
                res["prefill"] = cache.prefill_stats() if cache is not None else None
                res["stats"] = cache.stats() if cache is not None else None
    return res


def main(path: Path) -> dict[str, object]:
    dev = native.rpc_loopback_device()
    out: dict[str, object] = {"device": native.device_name(dev)}
    for n_ubatch in (512, 1024, 2048):
        out[str(n_ubatch)] = check(path, dev, n_ubatch)
    return out


if __name__ == "__main__":
    # to a file: the RPC server thread prints connection messages to stdout at any time
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])))
