"""Run by tests/test_cache_rpc.py in a process of its own: the overlap of the cache's device experts with the
CPU's (the CPU/GPU overlap) on every MoE architecture's random-weight model, on llama.cpp's RPC backend.

For each model (argv[2:]): stock logits, then the lru expert cache (half the experts, at least one slot) on the
RPC device with overlap on and off: a prompt ubatch and four decode steps must equal stock bitwise, with one
overlapped device split per cached MoE layer and ubatch when on and none when off. Writes one JSON object
{file: result} to the file named by argv[1]; a result is {"equal_on", "equal_off", "n_overlap_on",
"n_overlap_off", "n_ubatch", "n_moe_layers", "equal_prefill", "prefill_layers", "ids_check", "equal_checked"} or
{"error": "..."}; prefill: the same cache with the prompt's experts outside the slots run on the device from the
prefill buffers; ids_check: the checker's counts (llama_moe_set_ids_check) over that run, made once more with it on;
"equal_borrow", "borrow", "borrow_ids_check" (or "borrow_refused"): the prefill buffers borrowing the slots.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split
import json

import numpy as np

from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.expert_cache import ExpertCacheError

CFG = LoadConfig(n_ctx=128, n_batch=32, n_ubatch=32, n_threads=2, use_extra_bufts=False, op_offload=False)


def run(eng: Engine, toks: list[int]) -> list[np.ndarray]:
    out = [np.array(eng.eval_logits(toks[:-4]))]
    for tok in toks[-4:]:
        eng.feed([tok])
        out.append(np.array(eng.logits(-1)))
    return out


def check(path: Path, dev: object) -> dict[str, object]:
    with Engine(path, CFG) as eng:
        n_vocab = eng.n_vocab
        toks = [int(t) for t in np.random.default_rng(0).integers(1, min(n_vocab, 200), 20)]
        ref = run(eng, toks)
        slots = max(1, eng.info.n_expert // 2)
        n_moe = len(eng.info.moe_layers)
    res: dict[str, object] = {"n_moe_layers": n_moe}
    for overlap in (True, False):
        with Engine(path, CFG) as eng:
            eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(), overlap=overlap), device=dev)
            eng.reset_control_stats()
            got = run(eng, toks)
            st = eng.control_stats()
        tag = "on" if overlap else "off"
        res[f"equal_{tag}"] = all(np.array_equal(a, b) for a, b in zip(got, ref, strict=False))
        res[f"n_overlap_{tag}"] = st["n_overlap"]
        res["n_ubatch"] = st["n_ubatch"]
    # prefill on the device: the 16-token prompt from the prefill buffers, the decode steps as before
    with Engine(path, CFG) as eng:
        cache = eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(),
                                                    prefill_min_tokens=8), device=dev)
        got = run(eng, toks)
        pf = cache.prefill_stats()
    res["equal_prefill"] = all(np.array_equal(a, b) for a, b in zip(got, ref, strict=False))
    res["prefill_layers"] = pf["layers"] if pf else 0
    # the id rows handed to the device, checked: the prompt's from the prefill buffers, the decode steps' from the slots
    with Engine(path, CFG) as eng:
        eng.set_ids_check(True)
        eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(), prefill_min_tokens=8), device=dev)
        got = run(eng, toks)
        res["ids_check"] = eng.ids_check()
    res["equal_checked"] = all(np.array_equal(a, b) for a, b in zip(got, ref, strict=False))
    res.update(check_borrow(path, dev, toks, ref))
    return res


def check_borrow(path: Path, dev: object, toks: list[int], ref: list[np.ndarray]) -> dict[str, object]:
    """The prefill buffers over the last cached layers' slots (every expert slotted), the session twice (lent and
    refilled each time) with the id-row checker on; a model with one cached layer cannot lend them (refused)."""
    with Engine(path, CFG) as eng:
        eng.set_ids_check(True)
        cfg = CacheConfig(eng.info.n_expert, policy=LruConfig(), prefill_min_tokens=8, prefill_borrow=True)
        try:
            cache = eng.enable_expert_cache(cfg, device=dev)
        except ExpertCacheError as err:
            return {"equal_borrow": None, "borrow_refused": str(err)}
        got = run(eng, toks) + run(eng, toks)
        pf = cache.prefill_stats() if cache is not None else None
        return {"equal_borrow": all(np.array_equal(a, b) for a, b in zip(got, ref + ref, strict=False)),
                "borrow": (pf or {}).get("borrow"), "borrow_ids_check": eng.ids_check()}


def main(out_file: Path, paths: list[Path]) -> None:
    dev = native.rpc_loopback_device()
    results: dict[str, object] = {}
    for path in paths:
        try:
            results[path.name] = check(path, dev)
        except Exception as err:  # noqa: BLE001 - one architecture's failure is its result
            results[path.name] = {"error": f"{type(err).__name__}: {err}"}
        out_file.write_text(json.dumps(results))  # as it goes: a native abort leaves the others' results


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
