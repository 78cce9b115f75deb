"""Per-layer sensitivity S_l for adaptive top-k (AdapMoE §3 Observation 1, §4.2), two ways.

- Fisher (the paper's): S_l = sum of the diagonal of the Fisher information of the loss
  w.r.t. MoE layer l's output, estimated as the sum over calibration chunks of
  ||dL/dy_l||^2 (L = mean next-token NLL of the chunk), with the torch reference
  implementation loaded from the GGUF's dequantized weights (qwen3moe, Mixtral-style).
  The common scale of all S_l is irrelevant: the threshold is calibrated on it.
- Empirical (any GGUF): the NLL increase when layer l alone keeps only the top-1 expert
  of every token (for k = 2 that is dropping the second), measured through the hook.
  Dropping only the last of k > 2 experts moves the NLL of the tiny fixtures by less
  than the noise of a few thousand calibration tokens; top-1 is the signal the rule needs.

Both are stored as sensitivity.json in a calibration directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import EdgeMoeError
from ..policies.route import RouteRecord

if TYPE_CHECKING:
    from .stages import StageContext

FILE_NAME = "sensitivity.json"
VALIDATION_TOKENS = "gating_validation_tokens.npy"  # held-out tokens for --target-reduction


@dataclass(frozen=True)
class Sensitivity:
    empirical: dict[int, float]  # layer -> NLL increase (nats/token) when the layer alone goes top-1
    fisher: dict[int, float] | None  # layer -> sum diag Fisher; None where the reference lacks the arch
    base_nll: float
    tokens: int
    spearman: float | None  # rank agreement of the two

    def of(self, kind: str) -> dict[int, float]:
        values = self.fisher if kind == "fisher" else self.empirical
        if values is None:
            raise EdgeMoeError(
                "this calibration has no Fisher sensitivity (the torch reference does not implement "
                "the architecture); use `gating='empirical'`"
            )
        return values

    def save(self, directory: Path) -> Path:
        from .card import write_json

        write_json(directory / FILE_NAME, asdict(self))
        return directory / FILE_NAME

    @classmethod
    def load(cls, directory: Path) -> Sensitivity:
        path = directory / FILE_NAME
        if not path.exists():
            raise EdgeMoeError(
                f"{directory} has no {FILE_NAME}; run `edgemoe calibrate MODEL --corpus FILE ...`"
            )
        d = json.loads(path.read_text())
        to_map = lambda m: None if m is None else {int(k): float(v) for k, v in m.items()}  # noqa: E731
        return cls(
            empirical=cast("dict[int, float]", to_map(d["empirical"])),
            fisher=to_map(d["fisher"]),
            base_nll=d["base_nll"],
            tokens=d["tokens"],
            spearman=d["spearman"],
        )


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (no ties expected)."""
    ra = np.argsort(np.argsort(np.asarray(a)))
    rb = np.argsort(np.argsort(np.asarray(b)))
    if len(ra) < 2:
        return 1.0
    return float(np.corrcoef(ra, rb)[0, 1])


def fisher_sensitivity(model_path: Path, chunks: Sequence[Sequence[int]]) -> dict[int, float]:
    """sum_chunks ||dL/dy_l||^2 per MoE layer, L the chunk's mean next-token NLL (torch reference)."""
    import torch
    import torch.nn.functional as F

    from ..torchref.gguf_import import load_gguf_model

    model = load_gguf_model(model_path)
    outs: dict[int, torch.Tensor] = {}

    def grab(i: int) -> Callable[..., None]:
        def hook(module: object, inputs: object, output: tuple[torch.Tensor, object]) -> None:
            output[0].retain_grad()
            outs[i] = output[0]

        return hook

    handles = [b.moe.register_forward_hook(grab(i)) for i, b in enumerate(model.blocks)]
    total = np.zeros(len(model.blocks))
    try:
        for c in chunks:
            x = torch.tensor([list(c)])
            logits, _ = model(x[:, :-1])
            loss = F.cross_entropy(logits[0], x[0, 1:])
            model.zero_grad(set_to_none=True)
            loss.backward()
            for i, y in outs.items():
                assert y.grad is not None  # retain_grad() and backward() ran
                total[i] += float((y.grad.double() ** 2).sum())
    finally:
        for h in handles:
            h.remove()
    return {i: float(v) for i, v in enumerate(total)}


class Top1InLayer:
    """Keeps only the top-1 expert of every token in one layer (weight 1)."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def on_route(self, route: RouteRecord) -> None:
        if route.layer == self.layer and route.n_expert_used > 1:
            route.ids[:, 1:] = -1
            route.weights[:, 1:] = 0.0
            route.weights[:, 0] = 1.0


def empirical_sensitivity(
    engine: object, tokens: Sequence[int], *, ctx: int, progress: Callable[[int], None] | None = None
) -> tuple[dict[int, float], float, int]:
    """(layer -> NLL increase, base NLL, scored tokens) from each layer alone going top-1."""
    from ..analysis.perplexity import perplexity

    base = perplexity(engine, tokens, ctx=ctx)  # type: ignore[arg-type]
    out: dict[int, float] = {}
    for il in engine.info.moe_layers:  # type: ignore[attr-defined]
        r = perplexity(engine, tokens, ctx=ctx, policies=[Top1InLayer(il)])  # type: ignore[arg-type]
        out[int(il)] = r.nll - base.nll
        if progress:
            progress(1)
    return out, base.nll, base.tokens


def calibrate_sensitivity(
    model_path: Path,
    engine: object,
    tokens: Sequence[int],
    *,
    ctx: int = 256,
    progress: Callable[[int], None] | None = None,
) -> Sensitivity:
    """Both sensitivities on calibration tokens (train split only)."""
    from ..analysis.perplexity import chunk_tokens
    from ..errors import UnsupportedArchitectureError

    emp, base_nll, n = empirical_sensitivity(engine, tokens, ctx=ctx, progress=progress)
    bos = engine.bos_token() if engine.adds_bos() else None  # type: ignore[attr-defined]
    try:
        fisher_by_block = fisher_sensitivity(model_path, chunk_tokens(tokens, ctx, bos))
        layers = list(engine.info.moe_layers)  # type: ignore[attr-defined]
        fisher: dict[int, float] | None = {int(il): fisher_by_block[j] for j, il in enumerate(layers)}
    except UnsupportedArchitectureError:
        fisher = None
    rho = spearman([fisher[k] for k in sorted(emp)], [emp[k] for k in sorted(emp)]) if fisher else None
    return Sensitivity(empirical=emp, fisher=fisher, base_nll=base_nll, tokens=n, spearman=rho)


def save_validation_tokens(directory: Path, tokens: Sequence[int]) -> None:
    tmp = directory / (VALIDATION_TOKENS + ".tmp")
    with tmp.open("wb") as f:
        np.save(f, np.asarray(tokens, np.int32))
    os.replace(tmp, directory / VALIDATION_TOKENS)


def sensitivity_stage(ctx: StageContext) -> dict[str, object]:
    """Calibration stage `sensitivity`: sensitivity.json + the validation tokens for --target-reduction.

    Options (ctx.options["sensitivity"]): tokens (calibration tokens, default min(budget, 4096)),
    validation_tokens (default 2048), ctx (chunk length, default 256). Calibration and validation
    tokens come from disjoint halves of the first 400 kB of each corpus' train split.
    """
    opts = ctx.options.get("sensitivity", {})
    n_cal = int(opts.get("tokens", min(ctx.tokens, 4096)))
    n_val = int(opts.get("validation_tokens", 2048))
    chunk = int(opts.get("ctx", 256))
    per_cal, per_val = n_cal // len(ctx.texts), n_val // len(ctx.texts)
    with ctx.open_engine() as eng:
        cal: list[int] = []
        val: list[int] = []
        for t in ctx.texts:
            head = t.data[:400_000].decode("utf-8", errors="replace")
            half = len(head) // 2
            cal += eng.tokenize(head[:half], add_special=False)[:per_cal]
            val += eng.tokenize(head[half:], add_special=False)[:per_val]
        with ctx.progress(len(eng.info.moe_layers), "sensitivity", unit="layer") as advance:
            sens = calibrate_sensitivity(ctx.model, eng, cal, ctx=chunk, progress=advance)
    sens.save(ctx.out_dir)
    save_validation_tokens(ctx.out_dir, val)
    return {
        "files": [FILE_NAME, VALIDATION_TOKENS],
        "tokens": sens.tokens,
        "validation_tokens": len(val),
        "ctx": chunk,
        "base_nll": sens.base_nll,
        "spearman_fisher_empirical": sens.spearman,
        "fisher": {str(k): v for k, v in (sens.fisher or {}).items()} or None,
        "empirical": {str(k): v for k, v in sens.empirical.items()},
    }
