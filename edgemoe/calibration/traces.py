"""The built-in trace stages: record calibration traces on the train splits, and router frequencies."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .card import CalibrationError
from .stages import CorpusText, StageContext

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..analysis.trace import Trace
    from ..runtime.engine import Engine

log = logging.getLogger(__name__)

TRACE_MODE = "decode"
TRACE_PREFILL_FRACTION = 0.75  # of each chunk prefilled; the rest decoded one token per step


def eval_prefill_tokens(ctx: int) -> int:
    """Tokens prefilled at the start of each traced chunk of `ctx` tokens (the rest are decoded one by one)."""
    return max(1, int(ctx * TRACE_PREFILL_FRACTION))


def eval_tokens(eng: Engine, text: str, *, ctx: int, max_tokens: int) -> list[int]:
    """The tokens `predict-eval` traces from `text`: chunks of `ctx` tokens (BOS first when the model adds one),
    at most max_tokens in all."""
    from ..analysis.perplexity import chunk_tokens

    bos = eng.bos_token() if eng.adds_bos() else None
    return [t for c in chunk_tokens(eng.tokenize(text, add_special=False), ctx, bos) for t in c][:max_tokens]


def record_eval_trace(
    eng: Engine, text: str, *, ctx: int, max_tokens: int, progress: Callable[[int], None] | None = None
) -> Trace:
    """`predict-eval`'s trace of `text`, gate inputs on: each chunk of eval_tokens 3/4 prefilled, 1/4 decoded,
    as the calibration traces are recorded."""
    from ..analysis.trace import record_trace

    return record_trace(
        eng,
        eval_tokens(eng, text, ctx=ctx, max_tokens=max_tokens),
        ctx=ctx,
        mode=TRACE_MODE,
        gate_inputs=True,
        progress=progress,
        prefill_tokens=eval_prefill_tokens(ctx),
    )


def _chunk(eng: Engine, data: bytes, start: int, ctx: int) -> tuple[list[int], int] | None:
    """ctx tokens of data from `start` (BOS first when the model adds one) and the bytes they cover."""
    span = ctx * 8
    while True:
        end = min(len(data), start + span)
        toks = eng.tokenize(data[start:end].decode("utf-8", errors="ignore"))
        if len(toks) >= ctx or end == len(data):
            break
        span *= 2
    if len(toks) < ctx:
        return None
    toks = toks[:ctx]
    covered = sum(len(eng.token_piece(t)) for t in toks)  # specials (BOS) have an empty piece
    return toks, start + covered


def select_chunks(
    eng: Engine, texts: Sequence[CorpusText], tokens: int, ctx: int
) -> tuple[list[int], list[list[list[int]]]]:
    """Chunks of ctx tokens spread evenly over each train split (an equal share of `tokens` per corpus).

    Returns the flat token list (a multiple of ctx) and, per corpus, the file byte ranges used.
    """
    flat: list[int] = []
    ranges: list[list[list[int]]] = []
    per_corpus = math.ceil(tokens / max(len(texts), 1))
    for tx in texts:
        n_chunks = max(1, math.ceil(per_corpus / ctx))
        used: list[list[int]] = []
        for c in range(n_chunks):
            start = int(c * len(tx.data) / n_chunks)
            if start > 0:  # begin at a line start
                nl = tx.data.find(b"\n", start)
                start = nl + 1 if 0 <= nl < len(tx.data) - 1 else start
            got = _chunk(eng, tx.data, start, ctx)
            if got is None:
                log.warning(
                    "%s: too little text after byte %d for a chunk of %d tokens", tx.path.name, start, ctx
                )
                continue
            toks, end = got
            flat += toks
            off = tx.byte_range[0]
            used.append([off + start, off + end])
        ranges.append(used)
    return flat, ranges


def traces_stage(ctx: StageContext) -> dict[str, Any]:
    """Record calibration traces (gate inputs on) on the train splits: the 'decode' mode mix."""
    from ..analysis.trace import record_trace

    prefill = max(1, int(ctx.ctx * TRACE_PREFILL_FRACTION))
    with ctx.open_engine() as eng:
        flat, ranges = select_chunks(eng, ctx.texts, ctx.tokens, ctx.ctx)
        if len(flat) < 2 * ctx.ctx:
            raise CalibrationError(
                f"the corpora give {len(flat)} tokens, fewer than 2 chunks of `ctx={ctx.ctx}`: "
                "give more text or a lower `ctx`"
            )
        with ctx.progress(len(flat), "traces", unit="tok") as bar:
            tr = record_trace(
                eng,
                flat,
                ctx=ctx.ctx,
                mode=TRACE_MODE,
                prefill_tokens=prefill,
                gate_inputs=True,
                progress=bar,
            )
    ctx.artifacts["traces"] = tr
    return {
        "mode": TRACE_MODE,
        "prefill_tokens": prefill,
        "ctx": ctx.ctx,
        "tokens": tr.n_tokens,
        "sequences": len(np.unique(tr.seq)),
        "gate_inputs_mib": round(tr.gate_inputs.nbytes / 2**20, 1) if tr.gate_inputs is not None else 0,
        "ranges": {str(tx.path): r for tx, r in zip(ctx.texts, ranges, strict=False)},
    }


def router_frequency_stage(ctx: StageContext) -> dict[str, Any]:
    """Per-layer expert frequencies over all calibration tokens, and over prefill / decode tokens."""
    from ..analysis.trace import DECODE, PREFILL
    from ..analysis.trace_stats import expert_counts, prefill_decode_similarity

    tr = ctx.traces()
    E = tr.n_expert
    counts = expert_counts(tr.ids, E)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -(np.where(share > 0, share * np.log(share), 0.0)).sum(1) / np.log(E)
    rel = "router_frequency.npz"
    with (ctx.out_dir / rel).open("wb") as f:
        np.savez_compressed(
            f,
            layers=tr.layers,
            counts=counts,
            prefill_counts=expert_counts(tr.ids[tr.phase == PREFILL], E),
            decode_counts=expert_counts(tr.ids[tr.phase == DECODE], E),
            frequency=share.astype(np.float32),
        )
    sim = prefill_decode_similarity(tr.ids, tr.phase, E)
    return {
        "file": rel,
        "tokens": tr.n_tokens,
        "entropy": np.round(entropy, 4).tolist(),
        "skew": np.round(share.max(1) * E, 3).tolist(),
        "prefill_decode_similarity": None if sim is None else np.round(sim, 4).tolist(),
    }
