"""`bench --kld BASE`: beside each row that changes the output, its KL divergence and same-top rate against a base.

A row changes the output when it pre-calculates experts (`+precalc`), gates or degrades its routing (`+gating`,
`+degrade`), or runs a quantized KV cache (every row of a bench with `-ctk`/`-ctv` other than f16). The expert
cache's other rows compute what stock llama.cpp computes (the same experts and weights; bitwise where both read
the same buffers, tests/test_expert_cache.py, else last bits apart) and get no column.

The base is `edgemoe perplexity MODEL --input TEXT --kl-divergence-base BASE` of the full model; it holds the text's
tokens, its chunk length and the prompt rows of each chunk. Each row runs again on those chunks, as it decodes: a
fresh sequence per chunk, its first `--prompt-tokens` tokens in one ubatch, then one token per ubatch (so the
decode-only rules and the pre-calculation act on every scored token), through an engine set up as the row was;
its scored logits are compared with the base's (edgemoe.analysis.kld); the column is the row's `kld` metric (RowResult.metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...analysis.kld import KldComparison
from ...analysis.kld_base import KldBase, run_key
from ...analysis.perplexity import chunk_tokens
from ...analysis.precalc_run import stepped_logits
from ...runtime.config import LoadConfig
from ...runtime.engine import Engine
from .records import BenchRow, RowResult

_CHANGES = (" +precalc ", " +gating", " +degrade")


def changes_output(name: str, cfg: LoadConfig) -> bool:
    """Does a bench row (its name and load config) compute other logits than stock llama.cpp?"""
    return any(tag in name + " " for tag in _CHANGES) or (cfg.cache_type_k, cfg.cache_type_v) != (
        "f16",
        "f16",
    )


def row_kld(
    path: Path, cfg: LoadConfig, setup: Callable[[Engine], None] | None, base: KldBase
) -> dict[str, Any]:
    """The row's figures against `base`: KldResult.to_dict() (KldBaseError for a base of another model); `cfg`'s
    context must hold the base's chunks."""
    ctx, skip = int(base.meta["ctx"]), int(base.meta["score_from"])
    tokens = base.tokens.tolist()
    with Engine(path, cfg) as eng:
        if setup is not None:
            setup(eng)
        base.check(run_key(eng, tokens, ctx=ctx, score_from=skip), "the bench's KLD base (`kld_base`)")
        cmp = KldComparison(base)
        bos = eng.bos_token() if eng.adds_bos() else None
        for c in chunk_tokens(tokens, ctx, bos):
            if len(c) - 1 <= skip:
                continue
            logits = stepped_logits(eng, c, skip)
            cmp(logits[skip:-1], np.asarray(c[skip + 1 :]))
        return cmp.result().to_dict()


def add_kld_column(
    results: Sequence[RowResult],
    rows: Sequence[BenchRow],
    path: Path,
    base_path: Path,
    setup: Callable[[Engine, BenchRow], None],
    progress: Callable[[str], None] | None = None,
) -> tuple[RowResult, ...]:
    """Each measured row (`results`, in the order of `rows`) with its "kld" metric where its configuration changes
    the output (None where it does not); `setup` sets a row's cache, steps and speculation on an opened engine."""
    base = KldBase.load(base_path)
    out: list[RowResult] = []
    for res, row in zip(results, rows, strict=True):
        cfg = row.placement.load
        kld = None
        if res.decode_tps > 0 and changes_output(row.name, cfg):
            if progress:
                progress(f"{row.name}: KL divergence against {base_path}")
            cfg = replace(cfg, n_ctx=max(cfg.n_ctx, int(base.meta["ctx"])))
            kld = row_kld(path, cfg, lambda eng, row=row: setup(eng, row), base)
        out.append(replace(res, metrics={**res.metrics, "kld": kld}))
    return tuple(out)


def kld_cells(kld: dict[str, Any] | None) -> tuple[str, str]:
    """The table's two cells (mean KLD, same top) of a row."""
    if not kld:
        return "-", "-"
    return f"{kld['mean_kld']:.4f}", f"{kld['same_top']:.1%}"
