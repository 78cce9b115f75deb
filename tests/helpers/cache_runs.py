"""Runs of a model with and without the expert cache on the CPU stand-in, for comparisons with stock bitwise.

Stock here is the same library with no hook and no cache, loaded with use_extra_bufts=False like the cached engine,
so both use the same CPU kernels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgemoe.policies.residency import Load
from edgemoe.runtime.cache_config import CacheConfig, ManualConfig
from edgemoe.runtime.engine import Engine, LoadConfig

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def run_prefill_and_steps(path: Path, toks: list[int], *, cache: CacheConfig | None = None,
                          rng: np.random.Generator | None = None,
                          decode_steps: int = 12) -> tuple[np.ndarray, list[np.ndarray], dict | None]:
    """Prefill logits (ubatch 64) and then the logits of single-token steps; random loads between steps."""
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        c = eng.enable_expert_cache(cache) if cache is not None else None

        def shuffle() -> None:
            if c is None or rng is None:
                return
            for il, n in c.n_slots.items():
                for s in range(n):
                    e = int(rng.integers(-1, eng.info.n_expert))  # -1 empties the slot
                    c.load(Load(il, e, s))

        shuffle()
        pre = np.array(eng.eval_logits(toks[:-decode_steps]))
        steps = []
        for tok in toks[-decode_steps:]:
            shuffle()
            eng.feed([tok])
            steps.append(np.array(eng.logits(-1)))
        return pre, steps, (c.stats() if c is not None else None)


def partial_copy_run(path: Path, rng: np.random.Generator, max_chunks: int
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, int], int]:
    """Stock logits fed one token at a time, and the same with half the experts resident and, before
    each token, an absent one prefetched over a random slot with at most max_chunks - 1 chunks issued;
    (ref, got, cache stats, synchronous loads before)."""
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        toks = eng.tokenize(TEXT)[:40]
        ref = []
        for tok in toks:
            eng.feed([tok], all_logits=True)
            ref.append(np.array(eng.logits(-1)))
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert, policy=ManualConfig()))
        n = eng.info.n_expert
        for il in eng.info.moe_layers:  # half the experts resident ...
            for e in range(0, n, 2):
                cache.load(Load(il, e, e))
        eng.reset()
        got = []
        for tok in toks:
            for il in eng.info.moe_layers:  # ... then an absent one prefetched over a random slot
                absent = [e for e in range(n) if cache.state(il, e) == "absent"]
                if absent:
                    cache.prefetch(Load(il, int(rng.choice(absent)), int(rng.integers(n))))
            cache.issue(int(rng.integers(0, max_chunks)))  # a few chunks: most copies stay half done
            eng.feed([tok], all_logits=True)
            got.append(np.array(eng.logits(-1)))
        n_first = n // 2 * len(eng.info.moe_layers)
        return np.stack(ref), np.stack(got), cache.stats(), n_first
