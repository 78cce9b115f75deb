"""Dropped experts (id -1 from the hook) are skipped by the expert matmuls (dropped slots as skipped ids).

Two checks beside the op tests (test_ops.py): the expert outputs of a dropped slot, read through
llama.cpp's own eval callback, are exactly zero (a computed expert never gives an all-zero row);
and logits with per-token drops equal an independent torch reference applying the same drops.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from edgemoe.analysis.verify import FnPolicy
from edgemoe.policies.gating import apply_keep
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime import native
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.torchref.model import MoEConfig

from helpers.stock import eval_callback_tensors
from helpers.torch_models import random_exported_model

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 2


def test_dropped_slots_are_not_computed(fixture_model: Path) -> None:
    """Drop the last slot of every token in every layer; its ffn_moe_down rows must be exactly 0."""
    with Engine(fixture_model, LoadConfig(n_ctx=128)) as eng:
        toks = eng.tokenize(TEXT)[:48]
        n_embd = eng.info.n_embd
    dropped: dict[int, np.ndarray] = {}

    @native.MoeHookFn
    def hook(route_p: ctypes._Pointer, ud: int) -> bool:  # type: ignore[type-arg]
        r = route_p.contents
        ids = np.ctypeslib.as_array(r.ids, shape=(r.n_tokens, r.n_expert_used))
        w = np.ctypeslib.as_array(r.weights, shape=(r.n_tokens, r.n_expert_used))
        ids[:, -1] = -1
        w[:, -1] = 0.0
        dropped[r.il] = ids.copy()
        return True

    flat = eval_callback_tensors(fixture_model, toks, "ffn_moe_down-", np.float32, hook=hook)
    down = {il: a.reshape(len(toks), -1, n_embd) for il, a in flat.items()}  # [T][k][n_embd]

    assert sorted(down) == sorted(dropped) and len(down) == 8
    for il, out in down.items():
        assert (dropped[il][:, -1] == -1).all()
        assert np.all(out[:, -1, :] == 0.0), f"layer {il}: a dropped slot produced output"
        # every kept slot ran an expert: no all-zero rows there
        assert np.all(np.abs(out[:, :-1, :]).max(-1) > 0.0), f"layer {il}"


def _drop_mask(layer: int, n_tokens: int, k: int) -> np.ndarray:
    """A fixed per-token pattern: slot j of token t is dropped when (3t + 5*layer + j) % 4 == 0, slot 0 never."""
    t = np.arange(n_tokens)[:, None]
    j = np.arange(k)[None, :]
    return ((3 * t + 5 * layer + j) % 4 != 0) | (j == 0)


@pytest.mark.parametrize("arch,n_expert,k,n_ff", [("qwen3moe", 16, 4, 64), ("llama", 8, 2, 256)])
def test_drops_equal_torch_reference(tmp_path: Path, arch: str, n_expert: int, k: int, n_ff: int) -> None:
    cfg = MoEConfig(arch=arch, n_vocab=512, n_layer=3, n_expert=n_expert, n_expert_used=k, n_ff_exp=n_ff)
    model, path = random_exported_model(tmp_path, cfg, seed=1)
    ids = torch.randint(0, 300, (40,))

    with torch.no_grad():
        full, _ = model(ids[None])
        for il, block in enumerate(model.blocks):
            block.moe.slot_mask = torch.from_numpy(_drop_mask(il, len(ids), k))
        ref, _ = model(ids[None])
    full_np, ref_np = full[0].numpy(), ref[0].numpy()

    n_dropped = 0

    def drop(r: RouteRecord) -> None:
        nonlocal n_dropped
        keep = _drop_mask(r.layer, r.n_tokens, r.n_expert_used)
        n_dropped += int((~keep).sum())
        apply_keep(r, keep)

    # flash attention off: the CPU's flash attention accumulates V in f16, which adds to the NMSE against torch's
    # f32 (NMSE 2.8e-6 on the llama case with it on, over the 2e-6 bound); this test is of the drops
    with Engine(path, LoadConfig(n_ctx=64, n_batch=64, n_ubatch=64, flash_attn="off")) as eng:
        eng.set_policies([FnPolicy(drop)])
        got = np.array(eng.eval_logits(ids.tolist()))

    def nmse(a: np.ndarray, b: np.ndarray) -> float:
        return float(((a - b) ** 2).mean() / (b ** 2).mean())

    assert n_dropped > 0
    assert nmse(got, ref_np) < 2e-6  # as the no-drop export test: f16 KV cache in llama.cpp
    assert nmse(full_np, ref_np) > 100 * nmse(got, ref_np)  # the drops matter far more than the noise
