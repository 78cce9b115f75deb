"""The most degenerate MoE: one expert per layer (n_expert = k = 1), from the synthetic tiny qwen3moe.

llama.cpp's random-model writer makes every MoE model with two experts, so the sweep never sees this
shape. Generation equals stock, `verify` passes (drop-last and swap have nothing to act on and say
so), gating runs, and the expert cache with its one slot equals stock bitwise.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.analysis.verify import run_checks
from edgemoe.gguf.synth import get_preset, write_synthetic
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.runtime.cache_config import CacheConfig, LruConfig

from helpers.stock import stock_greedy

PROMPT = "hello there, one expert"
PLAIN = dict(n_ctx=128, n_threads=1, use_extra_bufts=False)


@pytest.fixture(scope="module")
def one_expert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    preset = replace(get_preset("tiny-qwen3moe"), n_expert=1, n_expert_used=1)
    return write_synthetic(preset, tmp_path_factory.mktemp("one") / "one-expert.gguf", progress=False)


def test_generate_equals_stock_and_verify_passes(one_expert: Path) -> None:
    _, ref = stock_greedy(one_expert, PROMPT, 8, n_ctx=128, n_threads=1)
    with Engine(one_expert, LoadConfig(n_ctx=128, n_threads=1)) as eng:
        assert eng.info.n_expert == 1 and eng.info.n_expert_used == 1
        assert eng.generate(PROMPT, max_tokens=8, sampling=GREEDY).tokens == ref
    checks = {c.name: c for c in run_checks(one_expert, threads=1)}
    assert all(c.ok for c in checks.values()), checks
    assert "skipped" in checks["drop-last"].detail and "nothing to swap" in checks["swap"].detail


def _run(eng: Engine, toks: list[int]) -> np.ndarray:
    """Logits of a 4-token prefill, then one decode step per token (the same schedule on every side)."""
    rows = list(eng.eval_logits(toks[:4]))
    for t in toks[4:]:
        eng.feed([t])
        rows.append(np.array(eng.logits(-1)))
    return np.stack(rows)


def test_gating_and_the_cache_equal_stock(one_expert: Path) -> None:
    with Engine(one_expert, LoadConfig(**PLAIN)) as eng:
        toks = eng.tokenize(PROMPT)
        ref = _run(eng, toks)
    with Engine(one_expert, LoadConfig(**PLAIN)) as eng:
        assert eng.set_gating(GatingPolicy(GatingRule.SER, 0.9, decode_only=False)) == "graph"
        assert np.array_equal(_run(eng, toks), ref)  # slot 0 is never dropped
    with Engine(one_expert, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(1, policy=LruConfig()))
        got = _run(eng, toks)
        st = cache.stats()
    assert np.array_equal(got, ref), "the one-slot cache changed the logits"
    assert st["hits"] > 0 and st["misses"] > 0
