#!/usr/bin/env python3
"""Who issues the expert cache's loads: the caller's thread or llama.cpp's load worker.

  .venv/bin/python tools/bench_worker.py MODEL [--gen 32] [--reps 3] [--slots N] [--threads 1]
                                         [--server-threads 1] [--layout gpu|standin] [--json OUT]

The cache lives on llama.cpp's RPC backend on loopback (tools/bench_overlap.py describes the stand-in and
the two layouts), run by the native LRU with --slots slots per MoE layer (default: a quarter of the
experts, so decode misses and loads every token). Three configurations, median of --reps interleaved runs:

  stock       llama.cpp without a cache
  caller      the cache, loads issued on the caller's thread when it synchronises after each token
              (llama_moe_cache_set_async off: what the native LRU did before the load worker)
  worker      the cache, loads issued by the load worker while the caller goes on (the default)

Prints decode tokens/s and ms per token of each, worker vs caller, and per token: loads, host time issuing
the copies (on whichever thread), and the time the caller waited for the worker's chunk in flight. On the
stand-in a copy is the host building an RPC message and the server writing it into the slot (both CPUs
of this machine): the figures show what moves off the caller's thread, not PCIe speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.runtime import native  # noqa: E402
from edgemoe.runtime.cache_config import CacheConfig, LruConfig  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
CONFIGS = ("stock", "caller", "worker")


def decode(path: Path, cfg: LoadConfig, config: str, slots: int, gen: int, dev: object) -> dict[str, float]:
    """Decode tokens/s and the cache's counters per decode token of one run."""
    with Engine(path, cfg) as eng:
        cache = None
        if config != "stock":
            cache = eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(),
                                                        async_loads=config == "worker"),
                                            device=dev)
        g = eng.generate(PROMPT, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
        out = {"decode_tps": g.timings.decode_tps}
        if cache is not None:
            st = cache.stats()
            n = max(1, gen)
            out.update(decode_hit_rate=float(st["decode_hit_rate"] or 0.0), loads_per_token=st["loads"] / n,
                       issue_ms_per_token=1000 * st["issue_s"] / n,
                       worker_wait_ms_per_token=1000 * st["worker_wait_s"] / n,
                       worker_chunk_share=st["worker_chunks"] / max(1, st["chunks"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=0, help="slots per MoE layer (0: a quarter of the experts)")
    ap.add_argument("--threads", type=int, default=1, help="threads of this process's CPU backend")
    ap.add_argument("--server-threads", type=int, default=1, help="threads of the RPC server's backend")
    ap.add_argument("--layout", choices=("gpu", "standin"), default="gpu")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    info = read_model_info(args.model)
    slots = args.slots or max(1, info.n_expert // 4)
    dev = native.rpc_loopback_device(n_threads=args.server_threads)
    cfg = LoadConfig(n_ctx=512, n_threads=args.threads, use_extra_bufts=False, op_offload=False)
    if args.layout == "gpu":
        cfg = replace(cfg, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))

    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    for _ in range(args.reps):
        for c in CONFIGS:
            runs[c].append(decode(args.model, cfg, c, slots, args.gen, dev))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    row = {"model": args.model.name, "layout": args.layout, "device": native.device_name(dev),
           "threads": args.threads, "server_threads": args.server_threads, "slots": slots,
           "n_expert": info.n_expert, "gen": args.gen, "reps": args.reps,
           **{f"{c}_ms_per_token": round(1000 / med[c]["decode_tps"], 2) for c in CONFIGS},
           "worker_vs_caller": round(med["worker"]["decode_tps"] / med["caller"]["decode_tps"], 3),
           "worker_vs_stock": round(med["worker"]["decode_tps"] / med["stock"]["decode_tps"], 3),
           "caller_vs_stock": round(med["caller"]["decode_tps"] / med["stock"]["decode_tps"], 3),
           **{f"{c}_{k}": round(v, 3) for c in ("caller", "worker") for k, v in med[c].items() if k != "decode_tps"},
           "runs": runs}
    print(json.dumps({k: v for k, v in row.items() if k != "runs"}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
