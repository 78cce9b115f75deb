"""The torch reference computes what llama.cpp computes: export F32, compare logits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.torchref.model import MoEConfig, load_balancing_loss

from helpers.torch_models import random_exported_model


@pytest.mark.parametrize("arch,n_expert,k,n_ff", [("qwen3moe", 16, 4, 64), ("llama", 8, 2, 256)])
def test_export_reproduces_torch_logits(tmp_path: Path, arch: str, n_expert: int, k: int, n_ff: int) -> None:
    cfg = MoEConfig(arch=arch, n_vocab=512, n_layer=2, n_expert=n_expert, n_expert_used=k, n_ff_exp=n_ff)
    model, path = random_exported_model(tmp_path, cfg, seed=0)
    ids = torch.randint(0, 300, (40,))
    with torch.no_grad():
        ref, _ = model(ids[None])
    with Engine(path, LoadConfig(n_ctx=64, n_batch=64, n_ubatch=64)) as eng:
        got = np.array(eng.eval_logits(ids.tolist()))
    ref_np = ref[0].numpy()
    nmse = float(((got - ref_np) ** 2).mean() / (ref_np ** 2).mean())
    assert nmse < 2e-6, nmse  # f16 KV cache in llama.cpp; a wrong RoPE style or routing gives > 1e-2
    assert (got.argmax(-1) == ref_np.argmax(-1)).mean() > 0.97


def test_rope_styles_differ_and_preserve_norm() -> None:
    from edgemoe.torchref.model import apply_rope, rope_tables

    x = torch.randn(1, 1, 5, 8)
    cos, sin = rope_tables(5, 8, 10000.0)
    a, b = apply_rope(x, cos, sin, neox=True), apply_rope(x, cos, sin, neox=False)
    assert torch.allclose(a.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(b.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(a[:, :, 0], x[:, :, 0]) and not torch.allclose(a, b)


def test_load_balancing_loss_is_one_when_uniform() -> None:
    from edgemoe.torchref.model import RouteStats

    n, e = 64, 8
    ids = torch.arange(n * 2).reshape(n, 2) % e
    probs = torch.full((n, e), 1.0 / e)
    assert load_balancing_loss([RouteStats(probs=probs, ids=ids)], e).item() == pytest.approx(1.0)
    skewed = torch.zeros(n, 2, dtype=torch.long)
    p2 = torch.zeros(n, e)
    p2[:, 0] = 1.0
    assert load_balancing_loss([RouteStats(probs=p2, ids=skewed)], e).item() == pytest.approx(e)
