"""DAOP's pre-calculation measurements: the replayed residency, gate-reuse accuracy on a hand-made trace,
the numpy expert reference against llama.cpp's own expert outputs, and the torch forward with
pre-calculation switched off or with nothing to pre-calculate equal to the reference model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.daop_precalc import decode_residency, precalc_accuracy
from edgemoe.analysis.trace import DECODE, PREFILL, Trace
from edgemoe.gguf.experts import load_expert_layer
from edgemoe.policies.daop import DaopPolicy
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.stock import eval_callback_tensors

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 2


def _trace(ids: np.ndarray, phase: list[int], gate_inputs: np.ndarray | None = None) -> Trace:
    T, L, k = ids.shape
    return Trace(tokens=np.zeros(T, np.int32), layers=np.arange(L, dtype=np.int32), ids=ids.astype(np.int32),
                 weights=np.full((T, L, k), 1.0 / k, np.float32), phase=np.array(phase, np.uint8),
                 seq=np.zeros(T, np.int32), gate_inputs=gate_inputs, meta={"n_expert": 4, "n_batch": 512})


def test_decode_residency_shows_the_swap_from_the_second_decode_token() -> None:
    ids = np.array([[[2], [3]], [[2], [3]], [[0], [0]], [[0], [0]]])  # 2 prompt tokens, 2 decode tokens
    tr = _trace(ids, [PREFILL, PREFILL, DECODE, DECODE])
    pol = DaopPolicy({0: np.array([4, 3, 0, 0]), 1: np.array([4, 3, 0, 0])}, {0: 1, 1: 1}, n_expert=4)
    res = decode_residency(tr, pol)
    assert res.shape == (2, 2, 4)
    assert res[0, 0].tolist() == [True, False, False, False]  # the swap is prefetched at the first decode token
    assert res[1, 0].tolist() == [False, False, True, False] and res[1, 1].tolist() == [False, False, False, True]


def test_precalc_accuracy_counts_predicted_cpu_experts() -> None:
    # layer 1's router is the identity: the prediction for layer 1 is the argmax of layer 0's input
    eye = np.eye(4, dtype=np.float32)
    pred = [1, 2, 3, 1]
    true = [1, 3, 3, 0]
    ids = np.zeros((4, 2, 1), int)
    ids[:, 1, 0] = true
    gi = np.zeros((4, 2, 4), np.float16)
    gi[np.arange(4), 0, pred] = 1.0
    tr = _trace(ids, [DECODE] * 4, gi)
    res = np.zeros((4, 2, 4), bool)
    res[:, 1, 0] = True  # expert 0 of layer 1 is resident
    (acc,) = precalc_accuracy(tr, {0: eye, 1: eye}, res)
    # predicted CPU: 1, 2, 3, 1 (all four); selected CPU: 1, 3, 3 (token 3 selected resident expert 0)
    assert acc.topk_recall == 0.5 and acc.precision == 0.5 and acc.recall == pytest.approx(2 / 3)
    assert acc.cpu_per_token == 0.75 and acc.predicted_cpu_per_token == 1.0 and acc.wasted_per_token == 0.5


def test_expert_reference_matches_llama_cpp(fixture_model: Path) -> None:
    """The reference's expert outputs against llama.cpp's ffn_moe_down rows on the same inputs (llama.cpp
    quantizes the activations for its Q4_K products: about 1-2% apart)."""
    got = {}

    class Rec:
        wants_probs = False
        wants_gate_inp = True

        def on_route(self, r) -> None:  # type: ignore[no-untyped-def]
            got[r.layer] = (r.ids.copy(), r.gate_inp.copy())

    with Engine(fixture_model, LoadConfig(n_ctx=128)) as eng:
        toks = eng.tokenize(TEXT)[:32]
        n_embd = eng.info.n_embd
        eng.set_policies([Rec()])
        eng.eval_logits(toks)
    flat = eval_callback_tensors(fixture_model, toks, "ffn_moe_down-", np.float32)
    for il in (0, 5):
        down = flat[il].reshape(len(toks), -1, n_embd)
        ids, x = got[il]
        layer = load_expert_layer(fixture_model, il)
        err = [np.linalg.norm(layer.expert(int(ids[t, s]), x[t:t + 1])[0] - down[t, s]) / np.linalg.norm(down[t, s])
               for t in range(len(toks)) for s in range(ids.shape[1])]
        assert np.mean(err) < 0.03 and np.max(err) < 0.06, (il, np.mean(err), np.max(err))


@pytest.mark.long  # many forward passes: the long suite (`make test-long`)
def test_forward_precalc_off_or_idle_is_the_reference(fixture_model: Path) -> None:
    import torch

    from edgemoe.torchref.gguf_import import load_gguf_model
    from edgemoe.torchref.precalc import PrecalcCounts, forward_precalc

    model = load_gguf_model(fixture_model)
    toks = torch.arange(40) * 7 % model.cfg.n_vocab
    ref = model(toks[None])[0][0].detach()
    none = lambda j, ids: torch.zeros(model.cfg.n_expert, dtype=torch.bool)  # noqa: E731
    every = lambda j, ids: torch.ones(model.cfg.n_expert, dtype=torch.bool)  # noqa: E731
    assert torch.equal(forward_precalc(model, toks, none, start=8, enabled=False), ref)
    counts = PrecalcCounts()
    assert torch.equal(forward_precalc(model, toks, every, start=8, counts=counts), ref)  # nothing on the CPU
    assert counts.cpu == counts.precalc == 0
    out = forward_precalc(model, toks, none, start=8, counts=counts)
    assert torch.allclose(out[:8], ref[:8], atol=1e-4) and not torch.allclose(out, ref, atol=1e-2)  # prompt rows kept
    assert 0 < counts.precalc < counts.cpu
