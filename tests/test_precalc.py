"""DAOP's pre-calculation in llama.cpp's graph, on the CPU stand-in.

In a decode ubatch, each cached layer from `precalc_from` on has its experts predicted at the MoE layer before
by its own router on that layer's input; the predicted ones outside its slots run there, on that input, and
the layer takes their results for the routed experts outside its slots that were predicted. The output changes
(an approximation), so the ground truth is the torch reference's `forward_precalc` (edgemoe/torchref/precalc.py,
the same rule written independently on the dequantized weights), and stock llama.cpp wherever nothing can be
pre-calculated (every expert resident, no target layer, a prompt ubatch).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.precalc_run import stepped_logits
from edgemoe.cli.main import cli
from edgemoe.gguf.info import read_model_info
from edgemoe.policies.loads import Load
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.expert_cache import ExpertCacheError

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)
PROMPT = 12  # tokens in the prompt ubatch; the rest are decode steps


def _manual(eng: Engine, resident: int) -> None:
    """A manual cache whose slots s < resident hold expert s of every MoE layer (a fixed residency)."""
    c = eng.enable_expert_cache(CacheConfig(max(resident, 1), policy=ManualConfig()))
    assert c is not None
    for il in eng.info.moe_layers:
        for e in range(resident):
            c.load(Load(il, e, e))


def _stepped(path: Path, resident: int | None, first: int | None, n: int = 36) -> tuple[np.ndarray, dict | None]:
    """Logits of TEXT's first n tokens (a PROMPT-token ubatch, then one token per ubatch) and the precalc counters."""
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        st = None
        if resident is not None:
            _manual(eng, resident)
            assert eng.experts is not None
            eng.experts.set_precalc(first)
            eng.experts.reset_stats()
        logits = stepped_logits(eng, eng.tokenize(TEXT)[:n], PROMPT)
        if eng.experts is not None:
            st = eng.experts.precalc_stats()
        return logits, st


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of ||a - b|| / ||b||."""
    return float(np.mean(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


def test_precalc_follows_the_torch_reference(fixture_model: Path) -> None:
    """With 1 resident expert per layer (most routed experts on the CPU) and pre-calculation from layer 2: the
    llama.cpp logits are close to the reference's pre-calculated forward and far from stock, and the experts
    taken early are the reference's."""
    import torch

    from edgemoe.torchref.gguf_import import load_gguf_model
    from edgemoe.torchref.precalc import PrecalcCounts, forward_precalc

    first, n = 2, 36
    stock, _ = _stepped(fixture_model, None, None, n)
    on, st = _stepped(fixture_model, 1, first, n)
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        toks = eng.tokenize(TEXT)[:n]
    model = load_gguf_model(fixture_model)
    resident = torch.zeros(model.cfg.n_expert, dtype=torch.bool)
    resident[0] = True
    counts = PrecalcCounts()
    ref_on = forward_precalc(model, torch.tensor(toks), lambda j, ids: resident, start=PROMPT, first_target=first,
                             renorm=False, counts=counts).numpy()
    ref_off = forward_precalc(model, torch.tensor(toks), lambda j, ids: resident, start=PROMPT,
                              enabled=False).numpy()
    rows = slice(PROMPT, n)
    err_on, err_off = _rel(on[rows], ref_on[rows]), _rel(stock[rows], ref_off[rows])
    effect = _rel(ref_on[rows], ref_off[rows])
    assert effect > 0.02, effect  # the pre-calculation changes the reference's logits
    assert err_on < 0.25 * effect and err_on < 3 * err_off + 1e-3, (err_on, err_off, effect)
    assert _rel(on[rows], stock[rows]) > 0.5 * effect  # llama.cpp's changed as much
    assert np.array_equal(on[:PROMPT], stock[:PROMPT])  # the prompt ubatch is never pre-calculated
    # the reference counts the pre-calculated experts of layers >= first over the decode rows
    assert st is not None and st["layers"] == (n - PROMPT) * sum(il >= first for il in read_model_info(fixture_model).moe_layers)
    assert abs(st["used"] - counts.precalc) <= 0.05 * counts.precalc and st["used"] > 0, (st, counts)
    assert st["used"] <= st["computed"] and st["late"] > 0 and 0 < st["early_share"] < 1, st


def test_nothing_to_precalculate_is_stock(fixture_model: Path) -> None:
    """Every expert resident: nothing runs early and the logits are stock's bitwise; no target layer: nothing
    changes either; precalc off after on: stock again."""
    info = read_model_info(fixture_model)
    stock, _ = _stepped(fixture_model, None, None)
    every, st = _stepped(fixture_model, info.n_expert, 1)
    assert np.array_equal(every, stock)
    assert st is not None and st["layers"] > 0 and st["computed"] == st["used"] == st["late"] == 0, st
    beyond, st = _stepped(fixture_model, 1, info.n_layer)
    assert np.array_equal(beyond, stock) and st is not None and st["layers"] == 0, st
    off, st = _stepped(fixture_model, 1, None)
    assert np.array_equal(off, stock) and st is None


@pytest.mark.parametrize("preset", ["tiny-qwen2moe", "tiny-deepseek2", "tiny-olmoe", "tiny-gpt-oss"])
def test_precalc_on_random_architectures(preset: str, make_tiny_gguf) -> None:
    """Shared experts (qwen2moe, deepseek2), a dense first layer (deepseek2: layer 1 has no MoE layer before it),
    expert biases and softmax over the selected (gpt-oss): finite logits, the prompt untouched, experts taken
    early, the counters adding up, and stock again with every expert resident."""
    path = make_tiny_gguf(preset)
    info = read_model_info(path)
    stock, _ = _stepped(path, None, None, 24)
    on, st = _stepped(path, 1, 1, 24)
    assert np.isfinite(on).all() and np.array_equal(on[:PROMPT], stock[:PROMPT])
    targets = [il for il in info.moe_layers if il >= 1 and il - 1 in info.moe_layers]
    assert st is not None and st["layers"] == (24 - PROMPT) * len(targets), (preset, st)
    assert 0 < st["used"] <= st["computed"] and st["late"] >= 0, (preset, st)
    every, st = _stepped(path, info.n_expert, 1, 24)
    assert np.array_equal(every, stock) and st is not None and st["computed"] == 0, (preset, st)


def test_refusals_and_report(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        assert native.moe_cache_set_precalc(eng.handle.ctx, 1, 1) == -1  # no cache
        c = eng.enable_expert_cache(CacheConfig(2, policy=LruConfig(), precalc_from=3))
        assert c is not None and c.precalc == (3, 1)
        assert native.moe_cache_set_precalc(eng.handle.ctx, 1, -1) == -1
        with pytest.raises(ExpertCacheError, match="layer >= 1"):
            c.set_precalc(0)
        with pytest.raises(ExpertCacheError, match="1 or more"):
            c.set_precalc(2, 0)
        eng.generate("The list type", max_tokens=4)
        rep = eng.experts.report()["precalc"]
        assert rep["first_layer"] == 3 and rep["layers"] > 0 and rep["used"] + rep["late"] > 0, rep


def test_cli(fixture_model: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "The list type", "-n", "4", "--expert-slots",
                                 "2", "--precalc-from", "4", "--json"])
    assert r.exit_code == 0, r.output
    pre = json.loads(r.output.splitlines()[-1])["cache"]["precalc"]
    assert pre["first_layer"] == 4 and pre["layers"] > 0, pre
    for args, msg in ((["--precalc-from", "2"], "--expert-slots"),
                      (["--expert-slots", "2", "--precalc-from", "2", "--degrade", "0.8"], "--degrade"),
                      (["--expert-slots", "2", "--precalc-from", "2", "--blocking-loads"], "--blocking-loads"),
                      (["--expert-slots", "2", "--device-prefill-ahead", "routed"], "--device-prefill N"),
                      (["--expert-slots", "2", "--precalc-from", "8"], "no MoE layer from there on")):
        r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "x", "-n", "1", *args])
        assert r.exit_code == 2 and msg in r.output, (args, r.output)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2)
    r = CliRunner().invoke(cli, ["perplexity", str(fixture_model), "--input", str(text), "--ctx", "48",
                                 "--max-tokens", "96", "--expert-slots", "2", "--precalc-from", "3",
                                 "--prompt-tokens", "16", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.splitlines()[-1])["precalc"]
    assert d["tokens"] > 0 and d["stats"]["used"] > 0 and 0 < d["top1_agreement"] <= 1, d
    assert d["nll"] != d["nll_off"]  # it changes the output
