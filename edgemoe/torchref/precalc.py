"""DAOP's expert pre-calculation (Zhang et al., DATE 2025, §IV-C) in the torch reference: its effect on
the logits, which llama.cpp cannot show without a patch (a routing hook edits ids and weights, it cannot
feed a layer's experts another layer's hidden state).

DAOP predicts MoE layer j's experts with layer j's router on layer j-1's router input (gate reuse) and
runs the predicted ones that are on the CPU early, on layer j-1's hidden state. Here, for every token
from row `start` on and every layer j >= `first_target`: the selection is the true one (layer j's router
on its own input, weights as usual); a selected expert that is not resident and was predicted is
computed on the earlier input, either layer j-1's router input as it was (x_{j-1}, normalised by layer
j-1's ffn_norm) or, with `renorm`, layer j's ffn_norm applied to layer j-1's residual stream after
attention (the hidden state DAOP hands over, normalised as layer j would). Everything else is
MoEModel.forward's arithmetic, so `enabled=False` gives the reference's own logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import MoEModel, rope_tables

# (layer index, the prompt rows' selected ids (start, k)) -> (n_expert,) bool: resident experts
Residency = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class PrecalcCounts:
    cpu: int = 0  # selected experts not resident, rows >= start, every layer
    precalc: int = 0  # of these, the predicted ones (computed on the earlier hidden state)


@torch.no_grad()
def forward_precalc(
    model: MoEModel,
    tokens: torch.Tensor,
    residency: Residency,
    *,
    start: int,
    first_target: int = 1,
    renorm: bool = True,
    enabled: bool = True,
    counts: PrecalcCounts | None = None,
) -> torch.Tensor:
    """tokens (T,) -> logits (T, n_vocab) of one sequence with DAOP's pre-calculation (module docstring)."""
    cfg = model.cfg
    T = int(tokens.shape[0])
    cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_base)
    x = model.tok_embd(tokens[None])
    prev_h: torch.Tensor | None = None  # the previous block's residual stream after attention (T, D)
    prev_in: torch.Tensor | None = None  # the previous block's router input (T, D)
    for j, b in enumerate(model.blocks):
        h = (x + b.attn(b.attn_norm(x), cos, sin))[0]
        xin = b.ffn_norm(h)
        probs = F.softmax(b.moe.router(xin).float(), dim=-1)
        w, ids = probs.topk(cfg.n_expert_used, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        src = xin
        pre = torch.zeros_like(ids, dtype=torch.bool)
        cpu = ~residency(j, ids[:start])[ids]
        cpu[:start] = False
        if enabled and j >= first_target and prev_in is not None and prev_h is not None:
            pred = b.moe.router(prev_in).topk(cfg.n_expert_used, dim=-1).indices
            pre = cpu & (ids[:, :, None] == pred[:, None, :]).any(-1)
            src = b.ffn_norm(prev_h) if renorm else prev_in
        if counts is not None:
            counts.cpu += int(cpu.sum())
            counts.precalc += int(pre.sum())
        out = torch.zeros_like(xin)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            xe = torch.where(pre[tok, slot][:, None], src[tok], xin[tok])
            he = F.silu(xe @ b.moe.gate[e].T) * (xe @ b.moe.up[e].T)
            out.index_add_(0, tok, (he @ b.moe.down[e].T) * w[tok, slot][:, None])
        x = (h + out)[None]
        prev_h, prev_in = h, xin
    return model.output(model.out_norm(x))[0]
