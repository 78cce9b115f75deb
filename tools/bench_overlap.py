#!/usr/bin/env python3
"""CPU/device overlap of a layer's two expert branches, on llama.cpp's RPC backend standing in for a GPU.

  .venv/bin/python tools/bench_overlap.py MODEL [--gen 32] [--reps 3] [--slots N] [--threads 1]
                                          [--server-threads 1] [--json OUT]

An RPC server in this process serves the CPU backend on loopback with --server-threads threads: a device of
its own (own buffers, own thread, asynchronous graph runs and events) that computes while this process's
CPU backend (--threads threads) computes. Each MoE layer gets --slots slots (default: half the experts)
holding experts 0..slots-1 (manual placement), so a token's routed experts split between the two.
Decode tokens/s, median of --reps runs interleaved, for two layouts:

  standin     every layer's weights on the CPU, the cache on the device
  gpu         every layer on the device (-ngl 999), the routed experts in CPU memory (-ot exps=CPU),
              the cache on the device: the layout of `edgemoe chat` on a GPU

and, in each, four configurations:

  stock       llama.cpp without a cache (all routed experts on the CPU)
  stock_k1    the same with one expert per token (expert_used_count 1)
  serial      the cache, overlap off: the device's experts finish before the CPU's start
  overlap     the cache, overlap on (the default): the device's experts run while the CPU computes

The routed experts' time per token is E = (T_stock - T_k1) * k / (k - 1) (it is linear in the experts
per token); with the cache's decode hit rate h the two branches take about D = h E (device) and
C = (1 - h) E (CPU) per token, so serial pays C + D and overlap can hide at most min(C, D). Prints one
JSON object per layout: tokens/s and ms per token of each configuration, the branch estimates, the time
overlap hid (serial - overlap) and its share of min(C, D), and the overlapped device splits per token
(one per cached MoE layer). Both sides are CPUs of this machine (each with its own threads): the figures
show how much of the shorter branch overlap hides, not GPU speed.
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
from edgemoe.policies.residency import Load  # noqa: E402
from edgemoe.runtime import native  # noqa: E402
from edgemoe.runtime.cache_config import CacheConfig, ManualConfig  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
CONFIGS = ("stock", "stock_k1", "serial", "overlap")


def decode(path: Path, cfg: LoadConfig, config: str, slots: int, gen: int, dev: object) -> tuple[float, float, float]:
    """(decode tokens/s, overlapped device splits per ubatch, cache hit rate in decode) of one run."""
    with Engine(path, replace(cfg, expert_used_count=1) if config == "stock_k1" else cfg) as eng:
        hit_rate = 0.0
        if not config.startswith("stock"):
            cache = eng.enable_expert_cache(CacheConfig(slots, policy=ManualConfig(),
                                                        overlap=config == "overlap"),
                                            device=dev)
            assert cache is not None
            for il in eng.info.moe_layers:
                for e in range(slots):
                    cache.load(Load(il, e, e))
        eng.reset_control_stats()
        g = eng.generate(PROMPT, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
        st = eng.control_stats()
        if eng.experts is not None:
            cs = eng.experts.stats()
            hit_rate = float(cs["decode_hit_rate"] if cs["decode_hit_rate"] is not None else cs["hit_rate"])
    return g.timings.decode_tps, st["n_overlap"] / max(1, st["n_ubatch"]), hit_rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=0, help="slots per MoE layer (0: half the experts)")
    ap.add_argument("--threads", type=int, default=1, help="threads of this process's CPU backend")
    ap.add_argument("--server-threads", type=int, default=1, help="threads of the RPC server's backend")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    info = read_model_info(args.model)
    if info.n_expert_used < 2:
        ap.error(f"{args.model.name} routes {info.n_expert_used} expert per token: the expert time estimate "
                 "compares k with 1 expert per token, so it needs k >= 2")
    slots = args.slots or info.n_expert // 2
    dev = native.rpc_loopback_device(n_threads=args.server_threads)
    base = LoadConfig(n_ctx=512, n_threads=args.threads, use_extra_bufts=False, op_offload=False)
    layouts = {"standin": base,
               "gpu": replace(base, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))}

    results = []
    for layout, cfg in layouts.items():
        tps: dict[str, list[float]] = {c: [] for c in CONFIGS}
        per_ubatch: dict[str, float] = {}
        hits: list[float] = []
        for _ in range(args.reps):
            for c in CONFIGS:
                t, n, h = decode(args.model, cfg, c, slots, args.gen, dev)
                tps[c].append(t)
                per_ubatch[c] = n
                if c == "overlap":
                    hits.append(h)
        med = {c: statistics.median(v) for c, v in tps.items()}
        ms = {c: 1000 / med[c] for c in CONFIGS}
        k = info.n_expert_used
        experts_ms = (ms["stock"] - ms["stock_k1"]) * k / (k - 1)
        h = statistics.median(hits)
        device_ms, cpu_ms = h * experts_ms, (1 - h) * experts_ms
        hidden_ms = ms["serial"] - ms["overlap"]
        row = {"model": args.model.name, "layout": layout, "device": native.device_name(dev),
               "threads": args.threads, "server_threads": args.server_threads, "slots": slots,
               "n_expert": info.n_expert, "gen": args.gen, "reps": args.reps,
               **{f"{c}_decode_tps": round(med[c], 3) for c in CONFIGS},
               **{f"{c}_ms_per_token": round(ms[c], 2) for c in CONFIGS},
               "overlap_vs_serial": round(med["overlap"] / med["serial"], 3),
               "overlap_vs_stock": round(med["overlap"] / med["stock"], 3),
               "serial_vs_stock": round(med["serial"] / med["stock"], 3),
               "decode_hit_rate": round(h, 3),
               "experts_ms_per_token": round(experts_ms, 2),
               "device_branch_ms": round(device_ms, 2), "cpu_branch_ms": round(cpu_ms, 2),
               "hidden_ms": round(hidden_ms, 2),
               "hidden_share_of_ideal": round(hidden_ms / min(device_ms, cpu_ms), 3) if min(device_ms, cpu_ms) > 0 else None,
               "overlapped_splits_per_ubatch": round(per_ubatch["overlap"], 2),
               "runs": tps}
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
