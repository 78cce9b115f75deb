"""Held-out NLL / perplexity through edgemoe, with the expert activations actually computed.

The text's tokens are cut into chunks of `ctx` tokens, each evaluated as a fresh
sequence with every position's logits; every position after the first of a
chunk is scored (after the first `score_from`, with DAOP's prompt). With no
gating policy this is stock llama.cpp's computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..policies.route import RoutePolicy, RouteRecord

if TYPE_CHECKING:
    from ..runtime.engine import Engine

# what perplexity hands each chunk's scored rows to: (logits (rows, n_vocab), next tokens (rows,))
RowSink = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class PerplexityResult:
    nll: float  # mean negative log-likelihood per scored token (nats)
    ppl: float
    tokens: int  # scored tokens
    expert_activations: int  # (token, layer, expert) triples computed
    full_activations: int  # what full top-k would compute
    chunks: int

    @property
    def activation_reduction(self) -> float:
        return 1.0 - self.expert_activations / self.full_activations if self.full_activations else 0.0

    def to_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        d["activation_reduction"] = self.activation_reduction
        return d


class ActivationCounter:
    """Counts kept expert slots (id >= 0) after the policies before it in the chain."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self, *, decode_only: bool = False) -> None:
        self.kept = 0
        self.full = 0
        self.decode_only = decode_only  # count single-token ubatches only

    def on_route(self, route: RouteRecord) -> None:
        if self.decode_only and route.n_tokens > 1:
            return
        self.kept += int((route.ids >= 0).sum())
        self.full += route.ids.size


def chunk_tokens(tokens: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping chunks of ctx tokens (BOS first when the model adds one)."""
    body = ctx - (1 if bos is not None else 0)
    return [
        ([bos] if bos is not None else []) + list(tokens[i : i + body])
        for i in range(0, len(tokens) - 1, body)
        if len(tokens[i : i + body]) > 1
    ]


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum of -log p(target) over rows, computed in float64."""
    x = logits.astype(np.float64)
    x -= x.max(1, keepdims=True)
    lse = np.log(np.exp(x).sum(1))
    return float((lse - x[np.arange(len(targets)), targets]).sum())


def perplexity(
    engine: Engine,
    tokens: Sequence[int],
    *,
    ctx: int,
    policies: Sequence[RoutePolicy] = (),
    max_chunks: int | None = None,
    progress: Callable[[int], None] | None = None,
    score_from: int = 0,
    rows: RowSink | None = None,
) -> PerplexityResult:
    """Mean NLL of the chunks' tokens. score_from: the logits of each chunk's first rows are not scored
    (the token at position score_from + 1 is the first scored). rows: given each chunk's scored logits and
    their next tokens (a KL-divergence base recorder or comparison, edgemoe.analysis.kld)."""
    bos = engine.bos_token() if engine.adds_bos() else None
    chunks = chunk_tokens(tokens, ctx, bos)[:max_chunks]
    counter = ActivationCounter()
    engine.set_policies([*policies, counter])
    nll, n = 0.0, 0
    try:
        for c in chunks:
            logits = np.stack(engine.eval_logits(c))
            if len(c) - 1 <= score_from:
                continue
            scored, targets = logits[score_from:-1], np.array(c[score_from + 1 :])
            nll += log_softmax_nll(scored, targets)
            if rows is not None:
                rows(scored, targets)
            n += len(c) - 1 - score_from
            if progress:
                progress(len(c))
    finally:
        engine.set_policies(None)
    mean = nll / max(n, 1)
    return PerplexityResult(
        nll=mean,
        ppl=math.exp(mean),
        tokens=n,
        expert_activations=counter.kept,
        full_activations=counter.full,
        chunks=len(chunks),
    )
