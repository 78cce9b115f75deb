"""Torch reference of the MoE decoder architectures edgemoe's fixtures use.

Two llama.cpp architectures, computed exactly the way llama.cpp's graphs do
(src/models/qwen3moe.cpp, src/models/llama.cpp) so that a GGUF exported from
these weights reproduces the torch logits:

- ``qwen3moe``: per-head RMS q/k norms before RoPE, NEOX RoPE (rotate halves),
  softmax router over all experts, top-k, weights renormalised over the top-k.
- ``llama`` with experts (Mixtral): NORM RoPE (rotate adjacent pairs), no q/k
  norm, same softmax/top-k/renormalise routing.

Expert weights are stacked like GGUF stores them, so export is a transpose-free
copy: gate/up (n_expert, n_ff, n_embd), down (n_expert, n_embd, n_ff).
Used for training fixtures and, later, for gradients (Fisher sensitivity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    arch: str  # "qwen3moe" or "llama" (Mixtral-style)
    n_vocab: int
    n_embd: int = 256
    n_layer: int = 8
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 64  # feed-forward width of one expert
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    n_ctx_train: int = 512

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3moe"

    @property
    def rope_neox(self) -> bool:
        return self.arch == "qwen3moe"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(n_pos: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]  # (T, hd/2)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd/2)
    if neox:  # rotate (x[i], x[i + hd/2])
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # rotate adjacent pairs
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_head_kv * hd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_head_kv * hd, bias=False)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, cfg.n_head, cfg.head_dim)
        k = self.wk(x).view(B, T, cfg.n_head_kv, cfg.head_dim)
        v = self.wv(x).view(B, T, cfg.n_head_kv, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        q = apply_rope(q, cos, sin, cfg.rope_neox)
        k = apply_rope(k, cos, sin, cfg.rope_neox)
        rep = cfg.n_head // cfg.n_head_kv  # query head h reads kv head h // rep, as in llama.cpp
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim))
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.n_head * cfg.head_dim))


@dataclass
class RouteStats:
    """What one MoE layer did in a forward pass (for aux loss and diagnostics)."""

    probs: torch.Tensor  # (N, n_expert) router softmax
    ids: torch.Tensor  # (N, k) selected experts


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, D, Fx = cfg.n_expert, cfg.n_embd, cfg.n_ff_exp
        self.router = nn.Linear(D, E, bias=False)
        self.gate = nn.Parameter(torch.randn(E, Fx, D) / math.sqrt(D))  # (E, n_ff, n_embd)
        self.up = nn.Parameter(torch.randn(E, Fx, D) / math.sqrt(D))
        self.down = nn.Parameter(torch.randn(E, D, Fx) / math.sqrt(Fx))  # (E, n_embd, n_ff)
        # (N, k) bool, False drops that slot (weights renormalised over the kept ones): the reference
        # for the runtime's dropped experts; None = full top-k
        self.slot_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouteStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        probs = F.softmax(self.router(x).float(), dim=-1)  # (N, E)
        w, ids = probs.topk(self.cfg.n_expert_used, dim=-1)  # (N, k)
        w = w / w.sum(-1, keepdim=True)
        if self.slot_mask is not None:
            w = w * self.slot_mask
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.n_expert).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok = sel // self.cfg.n_expert_used
            xe = x[tok]
            h = F.silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)
            ye = (h @ self.down[e].T) * w.reshape(-1)[sel, None]
            out.index_add_(0, tok, ye)
        return out.reshape(shape), RouteStats(probs=probs, ids=ids)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.moe = MoE(cfg)

    def forward(self, x, cos, sin):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, stats = self.moe(self.ffn_norm(x))
        return x + y, stats


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        # typed as what it holds: an nn.ModuleList iterates and indexes as plain Modules
        self.blocks = cast("Sequence[Block]", nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)))
        self.out_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        nn.init.normal_(self.tok_embd.weight, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for b in self.blocks:  # scale residual projections down with depth (GPT-2)
            nn.init.normal_(b.attn.wo.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            b.moe.down.data.mul_(1.0 / math.sqrt(2 * cfg.n_layer))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[RouteStats]]:
        """tokens (B, T) -> logits (B, T, n_vocab) and per-layer routing stats."""
        T = tokens.shape[1]
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_base)
        x = self.tok_embd(tokens)
        stats = []
        for b in self.blocks:
            x, s = b(x, cos, sin)
            stats.append(s)
        return self.output(self.out_norm(x)), stats


def load_balancing_loss(stats: list[RouteStats], n_expert: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss, averaged over layers: n_expert * sum_e f_e * P_e."""
    total = torch.zeros(())
    for s in stats:
        f = torch.bincount(s.ids.reshape(-1), minlength=n_expert).float() / s.ids.numel()
        p = s.probs.mean(0)
        total = total + n_expert * (f * p).sum()
    return total / len(stats)
