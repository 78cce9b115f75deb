"""Run by tests/test_rpc_ubatch.py in a process of its own (a registered RPC device is seen by every model loaded
after it): big prefill ubatches through the expert cache on llama.cpp's RPC backend, against stock llama.cpp at
the same ubatch.

For each model (argv[2:]) and each ubatch of UBATCHES that its run's context holds: a prompt of PROMPT_TOKENS
tokens (more than two ubatches of 512, one whole ubatch of 2048 and a part of the next) prefilled in ubatches of
that size, then DECODE_STEPS decode steps; stock (no cache) and each VARIANTS entry (the lru cache with half the
experts on the RPC device, device prefill on) must give the same logits bitwise, the prompt's last token's and each
decode step's. A variant is a name and CacheConfig fields: a later switch (prefill borrowing slots) is one more
entry. Writes {file: {ubatch: {variant: {"equal", "prefill_layers", "prefill_ubatches", "n_ubatch"}}}} or
{file: {"error": "..."}} as JSON to argv[1], as it goes.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
import json
import os
from dataclasses import replace
from typing import Any

import numpy as np

from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig

UBATCHES = tuple(int(u) for u in os.environ.get("RPC_UBATCHES", "512,1024,2048").split(","))
PROMPT_TOKENS = 2048 + 64
DECODE_STEPS = 2
N_CTX = 2304  # the prompt and its decode steps, in llama.cpp's steps of 256
BASE = LoadConfig(n_ctx=N_CTX, n_threads=2, use_extra_bufts=False, op_offload=False)
# the cache's variants: CacheConfig fields over lru with half the experts (device prefill from 8 tokens)
VARIANTS: dict[str, dict[str, Any]] = {"device_prefill": {"prefill_min_tokens": 8}}


def run(eng: Engine, toks: list[int]) -> list[np.ndarray]:
    """The prompt's last logits, then each decode step's (copies)."""
    eng.feed(toks[:PROMPT_TOKENS])
    out = [np.ctypeslib.as_array(eng.logits(-1)).copy()]
    for tok in toks[PROMPT_TOKENS:]:
        eng.feed([tok])
        out.append(np.ctypeslib.as_array(eng.logits(-1)).copy())
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b, strict=False))


def check(path: Path, dev: object, ubatch: int) -> dict[str, object]:
    cfg = replace(BASE, n_batch=ubatch, n_ubatch=ubatch)
    with Engine(path, cfg) as eng:
        rng = np.random.default_rng(0)
        toks = [int(t) for t in rng.integers(1, min(eng.n_vocab, 200), PROMPT_TOKENS + DECODE_STEPS)]
        ref = run(eng, toks)
        slots = max(1, eng.info.n_expert // 2)
    res: dict[str, object] = {}
    for name, fields in VARIANTS.items():
        with Engine(path, cfg) as eng:
            cache = eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(), **fields), device=dev)
            assert cache is not None
            eng.reset_control_stats()
            got = run(eng, toks)
            pf = cache.prefill_stats()
            res[name] = {
                "equal": same(got, ref),
                "prefill_layers": pf["layers"] if pf else 0,
                "prefill_ubatches": pf["ubatches"] if pf else 0,
                "n_ubatch": eng.n_ubatch,
            }
    return res


def main(out_file: Path, paths: list[Path]) -> None:
    dev = native.rpc_loopback_device()
    results: dict[str, object] = {}
    for path in paths:
        try:
            results[path.name] = {str(u): check(path, dev, u) for u in UBATCHES}
        except Exception as err:  # noqa: BLE001 - one architecture's failure is its result
            results[path.name] = {"error": f"{type(err).__name__}: {err}"}
        out_file.write_text(json.dumps(results))  # as it goes: a native abort leaves the others' results


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
