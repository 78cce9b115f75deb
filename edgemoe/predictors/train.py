"""Torch training of the learned predictors (the only module that imports torch).

Both learn from soft targets: the target layer's routing distribution softmax(R_{l+d} h_{l+d}),
computed from the trace's gate inputs and the model's routers, with a KL loss (ProMoE trains
on the gate's output; AdapMoE eq. 9 is this KL for the first layer). Every (target layer,
distance) has its own weights; the layers of one distance are trained together as one batched
module (independent parameters, one pass over the data). Early stopping per layer on the
validation split's top-k recall; the weights of the best epoch are kept, and epoch 0 (the
initialisation: gate reuse) counts, so a learned predictor is never worse on validation than
what it starts from.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .base import ModelSpec
from .first_layer import FirstLayerPredictor
from .mlp import MLPPredictor, mlp_hidden

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 40  # most passes over the training split
    patience: int = 4  # epochs without a better validation recall before a layer stops improving
    batch: int = 256  # tokens per step
    lr: float = 1e-3  # AdamW, MLPs
    gate_lr: float = (
        1e-2  # AdamW, the first-layer linear gate (starts from a router; a larger step is stable)
    )
    weight_decay: float = 1e-2
    hidden: int | None = None  # MLP width; None = mlp_hidden(n_embd)
    seed: int = 0
    threads: int = 0  # torch CPU threads; 0 = torch's default


@dataclass(frozen=True)
class TrainData:
    """The calibration trace's arrays, split 9:1 by sequence into train / validation rows."""

    gate_inputs: np.ndarray  # (T, L, n_embd) float16
    ids: np.ndarray  # (T, L, k) int32
    train_rows: np.ndarray  # token indices that have a previous token in their sequence
    val_rows: np.ndarray


def _softmax_targets(h: torch.Tensor, routers: torch.Tensor) -> torch.Tensor:
    """h (B, P, n), routers (P, E, n) -> (B, P, E) routing probabilities (the teacher)."""
    return torch.softmax(torch.einsum("bpn,pen->bpe", h, routers), dim=-1)


def _recall(out: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """out (B, P, E), true (B, P, k) -> (P,) mean top-k recall."""
    k = true.shape[-1]
    pred = out.topk(k, dim=-1).indices
    hit = (pred.unsqueeze(-1) == true.unsqueeze(-2)).any(-2).float().mean(-1)  # (B, P)
    return hit.mean(0)


class _BatchedMLP(torch.nn.Module):
    """P independent two-layer MLPs with a frozen router skip: out_p = W2 relu(W1 x^ + b1) + b2 + R x."""

    skip: torch.Tensor  # buffers (register_buffer)
    mu: torch.Tensor
    sd: torch.Tensor

    def __init__(
        self,
        P: int,
        n: int,
        H: int,
        E: int,
        skip: torch.Tensor,
        mu: torch.Tensor,
        sd: torch.Tensor,
        gen: torch.Generator,
    ) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(n)
        self.w1 = torch.nn.Parameter((torch.rand(P, n, H, generator=gen) * 2 - 1) * bound)
        self.b1 = torch.nn.Parameter((torch.rand(P, H, generator=gen) * 2 - 1) * bound)
        self.w2 = torch.nn.Parameter(torch.zeros(P, H, E))  # zero: training starts at gate reuse
        self.b2 = torch.nn.Parameter(torch.zeros(P, E))
        self.register_buffer("skip", skip)  # (P, n, E)
        self.register_buffer("mu", mu)  # (P, n)
        self.register_buffer("sd", sd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, P, n) -> (B, P, E)
        z = torch.relu(torch.einsum("bpn,pnh->bph", (x - self.mu) / self.sd, self.w1) + self.b1)
        return torch.einsum("bph,phe->bpe", z, self.w2) + self.b2 + torch.einsum("bpn,pne->bpe", x, self.skip)


class _BatchedLinear(torch.nn.Module):
    """P linear gates without bias (AdapMoE's predictive gate), initialised from routers."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(init.clone())  # (P, E, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bpn,pen->bpe", x, self.w)


def _fit(
    model: torch.nn.Module,
    batch_fn: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    data: TrainData,
    cfg: TrainConfig,
    gen: torch.Generator,
    progress: Callable[[int], None] | None,
    lr: float,
) -> dict[str, Any]:
    """Train with KL to the teacher; per-slice (dim 0 of every parameter) early stopping on val recall."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)

    def val_recall() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            parts = [batch_fn(data.val_rows[i : i + 2048]) for i in range(0, len(data.val_rows), 2048)]
            return torch.stack([_recall(model(x), ids) * len(ids) for x, _, ids in parts]).sum(0) / len(
                data.val_rows
            )

    best = val_recall()
    best_state = {n: p.detach().clone() for n, p in model.named_parameters()}
    best_epoch = torch.zeros_like(best, dtype=torch.long)
    start = best.clone()
    stale = torch.zeros_like(best_epoch)
    epoch = 0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        order = data.train_rows[torch.randperm(len(data.train_rows), generator=gen).numpy()]
        for i in range(0, len(order), cfg.batch):
            x, teacher, _ = batch_fn(order[i : i + cfg.batch])
            loss = -(teacher * torch.log_softmax(model(x), dim=-1)).sum(-1).mean(0).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        r = val_recall()
        better = r > best
        with torch.no_grad():
            for n, p in model.named_parameters():
                best_state[n][better] = p[better]
        best = torch.where(better, r, best)
        best_epoch[better] = epoch
        stale = torch.where(better, torch.zeros_like(stale), stale + 1)
        if progress:
            progress(1)
        if bool((stale >= cfg.patience).all()):
            break
    if progress and epoch < cfg.epochs:
        progress(cfg.epochs - epoch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(best_state[n])
    return {
        "epochs_run": epoch,
        "best_epoch": best_epoch.tolist(),
        "val_recall_init": [round(float(x), 5) for x in start],
        "val_recall": [round(float(x), 5) for x in best],
    }


def _standardisation(g: np.ndarray, rows: np.ndarray, layers: slice) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std (P, n) of g[rows, layers], accumulated in float64 chunks."""
    s = s2 = 0.0
    for i in range(0, len(rows), 4096):
        x = g[rows[i : i + 4096], layers].astype(np.float64)
        s = s + x.sum(0)
        s2 = s2 + (x * x).sum(0)
    mu = np.asarray(s / len(rows))  # s is an array once a batch is summed
    sd = np.sqrt(np.maximum(s2 / len(rows) - mu * mu, 0.0)) + 1e-4
    return mu.astype(np.float32), sd.astype(np.float32)


def _set_threads(n: int) -> int:
    old = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    return old


def train_mlp(
    spec: ModelSpec,
    distance: int,
    data: TrainData,
    cfg: TrainConfig,
    progress: Callable[[int], None] | None = None,
) -> tuple[MLPPredictor, dict[str, Any]]:
    """All target layers d..L-1 of one distance; returns the numpy predictor (float16 weights) and a report."""
    t0 = time.perf_counter()
    old = _set_threads(cfg.threads)
    try:
        L, n, E = spec.n_layers, spec.n_embd, spec.n_expert
        P, H = L - distance, cfg.hidden or mlp_hidden(spec.n_embd)
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + distance)
        routers = torch.tensor(np.stack([spec.router(t) for t in range(distance, L)]))  # (P, E, n)
        mu, sd = _standardisation(data.gate_inputs, data.train_rows, slice(0, P))
        model = _BatchedMLP(
            P, n, H, E, routers.transpose(1, 2).contiguous(), torch.tensor(mu), torch.tensor(sd), gen
        )

        def batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            g = torch.from_numpy(data.gate_inputs[np.sort(rows)].astype(np.float32))  # (B, L, n)
            ids = torch.from_numpy(data.ids[np.sort(rows), distance:].astype(np.int64))
            return g[:, :P], _softmax_targets(g[:, distance:], routers), ids

        report = _fit(model, batch, data, cfg, gen, progress, cfg.lr)
        with torch.no_grad():  # fold the standardisation into the first layer
            w1 = model.w1 / model.sd[:, :, None]
            b1 = model.b1 - torch.einsum("pn,pnh->ph", model.mu / model.sd, model.w1)
        arrays = {
            "w1": w1.numpy().astype(np.float16),
            "b1": b1.numpy().astype(np.float32),
            "w2": model.w2.detach().numpy().astype(np.float16),
            "b2": model.b2.detach().numpy().astype(np.float32),
            "skip": model.skip.numpy().astype(np.float16),
        }
        if not all(np.isfinite(a).all() for a in arrays.values()):
            raise FloatingPointError("mlp weights overflow float16; lower --lr or check the gate inputs")
    finally:
        torch.set_num_threads(old)
    pred = MLPPredictor.from_arrays(spec, distance, arrays)
    report.update(hidden=H, params_per_layer=pred.n_params(), train_s=round(time.perf_counter() - t0, 2))
    return pred, report


def train_first_layer(
    spec: ModelSpec,
    distance: int,
    data: TrainData,
    cfg: TrainConfig,
    progress: Callable[[int], None] | None = None,
) -> tuple[FirstLayerPredictor, dict[str, Any]]:
    """Targets 0..d-1 from the previous token's layers L-d..L-1 (AdapMoE eq. 9 for d = 1)."""
    t0 = time.perf_counter()
    old = _set_threads(cfg.threads)
    try:
        L = spec.n_layers
        P = min(distance, L)
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + 100 + distance)
        routers = torch.tensor(np.stack([spec.router(t) for t in range(P)]))  # (P, E, n)
        src = [L + t - distance for t in range(P)]
        model = _BatchedLinear(routers)

        def batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            rows = np.sort(rows)
            prev = torch.from_numpy(data.gate_inputs[rows - 1][:, src].astype(np.float32))
            cur = torch.from_numpy(data.gate_inputs[rows, :P].astype(np.float32))
            ids = torch.from_numpy(data.ids[rows, :P].astype(np.int64))
            return prev, _softmax_targets(cur, routers), ids

        report = _fit(model, batch, data, cfg, gen, progress, cfg.gate_lr)
        w = model.w.detach().numpy().astype(np.float32)
    finally:
        torch.set_num_threads(old)
    pred = FirstLayerPredictor(spec, distance, w)
    report.update(params_per_layer=int(w[0].size), train_s=round(time.perf_counter() - t0, 2))
    return pred, report
