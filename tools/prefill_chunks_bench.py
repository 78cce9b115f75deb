"""The long-prompt CPU figures (docs/research/benchmarks.md, "Prefill ubatch and chunk boundaries"):

1. prefill tok/s of a long prompt at each ubatch (-ub, with a batch that holds it), stock and with the lru expert
   cache on the CPU stand-in (half the experts), repetitions interleaved;
2. the time to first token of a serve turn whose prompt is restored from a chunk boundary (serve's PrefixReuse:
   the first turn's live state was dropped for another key's request and did not fit the store, its boundary
   state did) against the same prompt prefilled in full.

    PYTHONPATH=. .venv/bin/python tools/prefill_chunks_bench.py [--model M] [--prompt-tokens 4000] [-t 2]

Prints one JSON object. Timings on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.prompt_cache import PromptCache
from edgemoe.serve.prefix_cache import PrefixReuse

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
UBATCHES = (512, 1024, 2048)
QUESTION = 64  # the new user turn's tokens


def _tokens(n_vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(16, min(n_vocab, 32000), n)]


def _ctx(n: int) -> int:
    return -(-(n + 2 * QUESTION + 64) // 256) * 256


def prefill_rates(model: Path, n: int, threads: int, reps: int) -> list[dict[str, Any]]:
    """Prefill tok/s of an n-token prompt at each ubatch, stock and lru with half the experts: every engine open at
    once, the repetitions interleaved (a shared machine's load hits them alike), the best and the median kept."""
    rows: dict[tuple[int, bool], list[float]] = {}
    with ExitStack() as stack:
        engines = {}
        for u in UBATCHES:
            for cache in (False, True):
                cfg = LoadConfig(
                    n_ctx=_ctx(n), n_batch=u, n_ubatch=u, n_threads=threads, use_extra_bufts=False
                )
                eng = stack.enter_context(Engine(model, cfg))
                if cache:
                    eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 2, policy=LruConfig()))
                engines[(u, cache)] = eng
        prompt = _tokens(next(iter(engines.values())).n_vocab, n, 0)
        for eng in engines.values():
            eng.generate(prompt[:16], max_tokens=1, sampling=GREEDY)  # warm-up
        for _ in range(reps):
            for key, eng in engines.items():
                eng.reset()
                rows.setdefault(key, []).append(
                    eng.generate(prompt, max_tokens=1, sampling=GREEDY).timings.prompt_tps
                )
    return [
        {
            "n_ubatch": u,
            "cache": "lru half" if cache else "stock",
            "prefill_tps_best": round(max(tps), 1),
            "prefill_tps_median": round(float(np.median(tps)), 1),
        }
        for (u, cache), tps in rows.items()
    ]


def boundary_ttft(model: Path, n: int, threads: int) -> dict[str, Any]:
    """TTFT of turn 2 restored from turn 1's chunk boundary vs prefilled in full (n_batch 512)."""
    cfg = LoadConfig(n_ctx=_ctx(n), n_threads=threads)
    with Engine(model, cfg) as eng:
        turn1 = _tokens(eng.n_vocab, n, 0)
        eng.generate(turn1[:16], max_tokens=1, sampling=GREEDY)  # warm-up
        eng.reset()
        probe = PromptCache(1 << 40)
        reuse = PrefixReuse(eng, probe, chunk=eng.n_batch)
        reuse.prepare("k", turn1)
        reply = eng.generate(turn1, max_tokens=8, sampling=GREEDY, ignore_eog=True).tokens
        reuse.done()
        (boundary,) = probe.scoped("k")
        # a store that holds the boundary's state but not the whole conversation's: the switch cannot keep it
        store = PromptCache(boundary.nbytes + boundary.nbytes // 100)
        store.put("k", boundary)
        reuse = PrefixReuse(eng, store, chunk=eng.n_batch)
        reuse.owner = "k"
        # another key's short request (under the store's 16-token minimum: not kept): the live state is dropped
        other = _tokens(eng.n_vocab, 8, 1)
        reuse.prepare("other", other)
        eng.generate(other, max_tokens=1, sampling=GREEDY)
        turn2 = turn1 + reply[:-1] + _tokens(eng.n_vocab, QUESTION, 2)
        t0 = time.perf_counter()
        cached = reuse.prepare("k", turn2)
        g = eng.generate(turn2, max_tokens=1, sampling=GREEDY)
        restored_s = time.perf_counter() - t0
        reuse.done()
        eng.reset()
        t0 = time.perf_counter()
        full = eng.generate(turn2, max_tokens=1, sampling=GREEDY)
        full_s = time.perf_counter() - t0
    return {
        "turn2_tokens": len(turn2),
        "boundary_tokens": len(boundary.tokens),
        "boundary_bytes": boundary.nbytes,
        "restored_cached_tokens": cached,
        "restored_ttft_s": round(restored_s, 3),
        "full_ttft_s": round(full_s, 3),
        "same_token": g.tokens == full.tokens,
        "restored_over_full": round(restored_s / full_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="interleaved prefills per configuration")
    args = ap.parse_args()
    out = {
        "model": args.model.name,
        "prompt_tokens": args.prompt_tokens,
        "threads": args.threads,
        "prefill": prefill_rates(args.model, args.prompt_tokens, args.threads, args.reps),
        "boundary_restore": boundary_ttft(args.model, args.prompt_tokens, args.threads),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
