"""Prefill on the cache's device, on the CPU stand-in.

A prompt ubatch of at least `prefill_min_tokens` tokens runs each cached layer's experts that are outside
its slots from one of two prefill buffers that hold a whole layer's experts, filled at the layer's routing
callback (what it routes and was not copied ahead) and one cached layer ahead (the next layer's experts
outside its slots, or what an in-graph predictor names). On the stand-in the buffers are CPU memory and
the kernels the CPU's, so the output must equal stock bitwise, through the tables and through the
routing callback, on every fixture architecture; the counters must add up. The device side (copy stream,
load worker, events) is checked on llama.cpp's RPC device in tests/test_cache_rpc.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.cli.main import cli
from edgemoe.gguf.info import read_model_info
from edgemoe.plan.budget import prefill_buffer_bytes
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.expert_cache import ExpertCacheError
from edgemoe.runtime.sampling import GREEDY

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PROMPT = "Lists are mutable sequences, typically used to store collections of homogeneous items."  # not a prefix of TEXT
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def _prompt_ubatches(path: Path) -> tuple[int, int]:
    """(ubatches of PROMPT with 8+ tokens, of them those whose last layer routes no token: all but the last)."""
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        n = len(eng.tokenize(PROMPT))
    sizes = [min(64, n - i) for i in range(0, n, 64)]
    return sum(s >= 8 for s in sizes), sum(s >= 8 for s in sizes[:-1])


def _run(path: Path, cache: CacheConfig | None) -> tuple[np.ndarray, list[int], dict | None, dict]:
    """Prompt logits (a 40-token ubatch), 8 greedy tokens after it, the prefill counters and control stats."""
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        c = eng.enable_expert_cache(cache) if cache is not None else None
        toks = eng.tokenize(TEXT)[:40]
        logits = np.array(eng.eval_logits(toks))
        eng.reset_control_stats()
        if c is not None:
            c.reset_stats()
        gen = eng.generate(PROMPT, max_tokens=8, sampling=GREEDY, ignore_eog=True).tokens
        return logits, gen, (c.prefill_stats() if c is not None else None), eng.control_stats()


def test_prefill_from_the_buffers_equals_stock(fixture_model: Path) -> None:
    _check_equal_to_stock(fixture_model)


@pytest.mark.parametrize("preset", ["tiny-qwen2moe", "tiny-deepseek2", "tiny-olmoe", "tiny-gpt-oss"])
def test_prefill_from_the_buffers_on_random_architectures(preset: str, make_tiny_gguf) -> None:
    """Shared experts (qwen2moe, deepseek2), dense leading layers (deepseek2), softmax over the selected and expert
    biases (gpt-oss): the buffers hold the biases too."""
    _check_equal_to_stock(make_tiny_gguf(preset))


def _check_equal_to_stock(path: Path) -> None:
    """Tables (lru, manual) and the routing callback (blocking lru): bitwise = stock; every cached layer of the
    prompt's ubatch stops once, decode never; nothing is late when every layer's experts are copied ahead."""
    info = read_model_info(path)
    n_moe = len(info.moe_layers)
    n_ub, n_silent = _prompt_ubatches(path)
    # the last layer of a ubatch with no output routes no token in most graphs (not counted; gpt-oss's does route)
    layers = range(n_ub * n_moe - n_silent * (info.n_layer - 1 in info.moe_layers), n_ub * n_moe + 1)
    ref_logits, ref_gen, _, _ = _run(path, None)
    for policy, blocking, slots in ((LruConfig(), False, info.n_expert // 4),
                                    (LruConfig(blocking=True), True, info.n_expert // 2),
                                    (ManualConfig(), False, 1)):
        cfg = CacheConfig(max(1, slots), policy=policy, prefill_min_tokens=8)
        logits, gen, st, control = _run(path, cfg)
        where = (path.name, policy.name, blocking)
        assert np.array_equal(logits, ref_logits) and gen == ref_gen, where
        assert st is not None and st["ubatches"] == n_ub >= 1 and st["layers"] in layers, (where, st)  # the prompt
        assert st["needed"] == st["ahead_used"] + st["late"] > 0 and st["bytes"] > 0, (where, st)
        if not blocking:
            # the tables: a stop per cached layer of the prompt's ubatch only; the first layer's copies are queued
            # before the graph, the others' at the layer before, so nothing is late
            assert control["n_host_syncs"] == n_ub * n_moe, (where, control)  # silent layers stop too
            assert st["late"] == 0, (where, st)
        assert st["buf_bytes"] >= prefill_buffer_bytes(info), (where, st)


def test_what_is_copied_ahead(fixture_model: Path) -> None:
    """all: every expert outside the slots, ahead; routed: nothing ahead, everything late; below the minimum the
    prompt runs as without (no stop, nothing copied)."""
    info = read_model_info(fixture_model)
    n_moe = len(info.moe_layers)
    ref_logits, ref_gen, _, _ = _run(fixture_model, None)
    logits, gen, st, _ = _run(fixture_model, CacheConfig(4, policy=LruConfig(), prefill_min_tokens=8,
                                                         prefill_ahead="all"))
    assert np.array_equal(logits, ref_logits) and gen == ref_gen
    # the lru's slots hold the first run's experts; all outside them are copied, and more than are needed
    assert st["late"] == 0 and st["needed"] <= st["ahead"] <= n_moe * info.n_expert, st
    logits, gen, st, _ = _run(fixture_model, CacheConfig(4, policy=LruConfig(), prefill_min_tokens=8,
                                                         prefill_ahead="routed"))
    assert np.array_equal(logits, ref_logits) and gen == ref_gen
    assert st["ahead"] == 0 and st["late"] == st["needed"] > 0 and st["late_share"] == 1.0, st
    logits, gen, st, control = _run(fixture_model, CacheConfig(4, policy=LruConfig(),
                                                               prefill_min_tokens=1000))
    assert np.array_equal(logits, ref_logits) and gen == ref_gen
    assert st["ubatches"] == 0 and st["bytes"] == 0 and control["n_host_syncs"] == 0, (st, control)


def test_refusals(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        assert native.moe_cache_set_prefill(eng.handle.ctx, 8) == -1  # no cache
        c = eng.enable_expert_cache(CacheConfig(2, policy=LruConfig()))
        assert native.moe_cache_set_prefill(eng.handle.ctx, -1) == -1
        with pytest.raises(ExpertCacheError, match="ahead"):
            c.set_prefill(8, "sometimes")
        with pytest.raises(ExpertCacheError, match="0 \\(off\\)"):
            c.set_prefill(-3)
        assert c.prefill_stats() is None  # off
        c.set_prefill(8)
        assert c.prefill_stats()["buf_bytes"] > 0
        c.set_prefill(0)
        assert c.prefill_stats() is None


def test_cli_device_prefill(fixture_model: Path) -> None:
    import json

    runner = CliRunner()
    res = runner.invoke(cli, ["generate", str(fixture_model), "-p", PROMPT, "-n", "4", "--device-prefill", "8"])
    assert res.exit_code != 0 and "--vram or --expert-slots" in res.output
    res = runner.invoke(cli, ["generate", str(fixture_model), "-p", PROMPT, "-n", "4", "--expert-slots", "4",
                              "--device-prefill", "8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    pf = out["cache"]["prefill"]
    assert pf["ubatches"] == 1 and pf["min_tokens"] == 8 and pf["late"] == 0 and pf["needed"] > 0, pf
    assert "prefill ubatches of 8+ tokens on the device" in res.stderr
