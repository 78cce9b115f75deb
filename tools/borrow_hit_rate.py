#!/usr/bin/env python3
"""Decode hit rate after a long prompt with device prefill's buffers in borrowed slots, and without.

    PYTHONPATH=. python tools/borrow_hit_rate.py MODEL [--rpc] [--prompt-tokens 4096] [--slots 12] [--decode 64]

Prefills an agent-length prompt (the repository's docs, tokenized, cut to --prompt-tokens) in ubatches of 512
and greedily generates --decode tokens with the native lru cache, in four configurations:

- no device prefill, --slots per layer;
- device prefill with buffers of its own, --slots per layer;
- device prefill borrowing the slots, --slots per layer (the cost of the lend and refill alone);
- device prefill borrowing the slots, --slots plus the slots the two buffers' bytes buy per layer (the same
  budget as the second row: what borrowing is for).

Prints one row per configuration: the decode hit rate over the generated tokens (the cache's counters split at the
first decode step), the prefill's, and the lent/refilled counts. --rpc: the cache on llama.cpp's RPC device on
loopback (the copy stream, events and the load worker's path), else the CPU stand-in. Hit rates only: neither
device's timings mean anything for a GPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from edgemoe.gguf.info import read_model_info
from edgemoe.plan.budget import prefill_buffer_bytes
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

ROOT = Path(__file__).resolve().parent.parent
N_UBATCH = 512
MIN_TOKENS = 32


@dataclass(frozen=True)
class Row:
    name: str
    slots: int
    prefill: bool
    borrow: bool


def agent_prompt(eng: Engine, n_tokens: int) -> list[int]:
    """The repository's docs as one long prompt (an agent's files and instructions), cut to n_tokens."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    toks = eng.tokenize(text)
    while len(toks) < n_tokens:
        toks += toks
    return toks[:n_tokens]


def measure(path: Path, row: Row, n_prompt: int, n_decode: int, device: object) -> dict[str, object]:
    cfg = LoadConfig(n_ctx=n_prompt + n_decode + 64, n_batch=N_UBATCH, n_ubatch=N_UBATCH, n_threads=2,
                     use_extra_bufts=False)
    with Engine(path, cfg) as eng:
        cache = eng.enable_expert_cache(
            CacheConfig(row.slots, policy=LruConfig(), prefill_min_tokens=MIN_TOKENS if row.prefill else 0,
                        prefill_borrow=row.borrow),
            device=device,
        )
        assert cache is not None
        eng.generate(agent_prompt(eng, n_prompt), max_tokens=n_decode, sampling=GREEDY, ignore_eog=True)
        st = cache.stats()
        pf = cache.prefill_stats() or {}
        return {"row": row.name, "slots": row.slots, "decode_hit_rate": st["decode_hit_rate"],
                "prefill_hit_rate": st["prefill_hit_rate"], "borrow": pf.get("borrow")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rpc", action="store_true", help="the cache on llama.cpp's RPC device on loopback")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=12)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()
    info = read_model_info(args.model)
    # the slots per layer that the two buffers' bytes buy when they are not reserved beside the slots
    extra = prefill_buffer_bytes(info) // max(1, info.slot_bytes)
    rows = [Row("no device prefill", args.slots, False, False),
            Row("device prefill, own buffers", args.slots, True, False),
            Row("device prefill, borrowed slots", args.slots, True, True),
            Row(f"borrowed, +{extra} slots (same budget)", min(info.n_expert, args.slots + extra), True, True)]
    device = native.rpc_loopback_device() if args.rpc else None
    for row in rows:
        print(json.dumps(measure(args.model, row, args.prompt_tokens, args.decode, device)), flush=True)


if __name__ == "__main__":
    main()
