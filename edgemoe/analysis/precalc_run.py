"""DAOP's pre-calculation as llama.cpp runs it (`CacheConfig.precalc_from`): its quality cost and its
gain on text, next to the same run without it (`edgemoe perplexity --precalc-from`, tools/daop_eval.py).

Each chunk is a fresh sequence: its first `prompt_tokens` tokens go in one ubatch (the prompt: never
pre-calculated), the rest one token per ubatch (decode steps, where the pre-calculation runs), every row's
logits kept. The residency is whatever the engine's expert cache holds (a static placement keeps it the same
for both runs). The gain is the share of the CPU's expert executions (routed, outside the slots) that ran a
layer early; the cost the NLL of the rows after the prompt, the top-1 agreement with the run without it and the
mean KL divergence from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..runtime.engine import Engine
from ..runtime.expert_cache import precalc_rates
from .kld import full_kld
from .perplexity import RowSink, chunk_tokens, log_softmax_nll


def stepped_logits(
    engine: Engine, tokens: Sequence[int], prompt_tokens: int, after_prompt: Callable[[], None] | None = None
) -> np.ndarray:
    """Fresh sequence: the prompt in one ubatch, then one token per ubatch; (len(tokens), n_vocab) logits.
    after_prompt runs between the two."""
    engine.reset()
    rows: list[np.ndarray] = []
    for n, part in enumerate([list(tokens[:prompt_tokens])] + [[t] for t in tokens[prompt_tokens:]]):
        if n == 1 and after_prompt is not None:
            after_prompt()
        if not part:
            continue
        engine.feed(part, all_logits=True)
        for i in range(len(part)):
            engine.check_logits(i)
            rows.append(np.ctypeslib.as_array(engine.logits(i)).copy())
    return np.stack(rows)


@dataclass
class PrecalcRun:
    tokens: int  # scored rows (after each chunk's prompt)
    nll: float  # mean NLL with the pre-calculation
    nll_off: float  # the same rows without it
    top1_agreement: float  # rows whose argmax is the same with and without it (llama.cpp's "same top p")
    stats: dict[str, Any]  # the cache's precalc counters over the runs with it (ExpertCache.precalc_stats)
    # the decode steps' CPU expert executions (routed, outside the slots) in every MoE layer, with it: the
    # cache's misses; stats["used"] / cpu_decode is the share of all of them that ran a layer early
    cpu_decode: int = 0
    mean_kld: float = 0.0  # mean KL(without || with) of the rows' next-token distributions, whole vocabulary

    @property
    def nll_change(self) -> float:
        return self.nll / self.nll_off - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "nll_change": self.nll_change}


def precalc_run(
    engine: Engine,
    tokens: Sequence[int],
    *,
    ctx: int,
    prompt_tokens: int,
    first_layer: int,
    max_chunks: int | None = None,
    progress: Callable[[int], None] | None = None,
    rows: RowSink | None = None,
) -> PrecalcRun:
    """Every chunk twice through the engine's expert cache: without the pre-calculation, then with it from
    first_layer on (decode steps only). Leaves it off. rows: given the scored rows with it (perplexity's)."""
    if engine.experts is None:
        raise ValueError("the pre-calculation acts on the expert cache: enable one first")
    cache = engine.experts
    bos = engine.bos_token() if engine.adds_bos() else None
    chunks = [c for c in chunk_tokens(tokens, ctx, bos)[:max_chunks] if len(c) - 1 > prompt_tokens]
    nll = nll_off = kld = 0.0
    n = agree = cpu_decode = 0
    stats: dict[str, Any] = {}
    try:
        for c in chunks:
            targets = np.asarray(c[prompt_tokens + 1 :])
            cache.set_precalc(None)
            off = stepped_logits(engine, c, prompt_tokens)[prompt_tokens:-1]
            cache.set_precalc(first_layer)
            on = stepped_logits(engine, c, prompt_tokens, after_prompt=cache.reset_stats)[prompt_tokens:-1]
            cpu_decode += cache.stats()["misses"]
            st = cache.precalc_stats() or {}
            for k in ("layers", "computed", "used", "late"):
                stats[k] = stats.get(k, 0) + st.get(k, 0)
            nll += log_softmax_nll(on, targets)
            if rows is not None:
                rows(on, targets)
            nll_off += log_softmax_nll(off, targets)
            agree += int((on.argmax(-1) == off.argmax(-1)).sum())
            kld += float(full_kld(off, on).sum())
            n += len(targets)
            if progress:
                progress(len(c))
    finally:
        cache.set_precalc(None)
    stats = {k: stats.get(k, 0) for k in ("layers", "computed", "used", "late")}
    stats |= {
        "first_layer": first_layer,
        **precalc_rates(stats),
        "early_share_all": stats["used"] / cpu_decode if cpu_decode else None,
    }
    return PrecalcRun(
        tokens=n,
        nll=nll / max(n, 1),
        nll_off=nll_off / max(n, 1),
        top1_agreement=agree / max(n, 1),
        stats=stats,
        cpu_decode=cpu_decode,
        mean_kld=kld / max(n, 1),
    )
