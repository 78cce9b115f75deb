"""Soak: 10k generated tokens on one Engine, in every control mode, with flat RSS.

Marked slow (not in the default run): `pytest -m slow tests/test_soak.py -s` prints the figures.
A leak per token (a route record, a ctypes array, a cache load) of even a few hundred bytes shows
as megabytes over 10k tokens; warm-up (KV cache, allocator pools) is excluded.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import SamplingParams

from helpers.models import FIXTURE_MODELS

pytestmark = pytest.mark.slow

TOKENS = 10_000
ROUND = 500  # tokens per generation; the context is reset between rounds
MODES = ["plain", "gating-graph", "gating-hook", "cache-lru"]


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def _setup(eng: Engine, mode: str) -> None:
    if mode == "gating-graph":
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.4))
    elif mode == "gating-hook":  # the Python route hook runs at every MoE layer of every token
        eng.set_policies([GatingPolicy(GatingRule.SER, 0.4)])
    elif mode == "cache-lru":
        eng.enable_expert_cache(CacheConfig(4, policy=LruConfig()))


@pytest.mark.parametrize("mode", MODES)
def test_10k_tokens_keep_rss_flat(mode: str) -> None:
    sampling = SamplingParams(temperature=0.8, seed=1)
    with Engine(FIXTURE_MODELS[-1], LoadConfig(n_ctx=ROUND + 64)) as eng:
        _setup(eng, mode)
        rss: list[int] = []
        done = 0
        while done < TOKENS:
            eng.reset()
            g = eng.generate("ROMEO:", max_tokens=ROUND, sampling=sampling, ignore_eog=True)
            done += len(g.tokens)
            rss.append(_rss_kib())
    growth = rss[-1] - rss[1]  # after the first two rounds (warm-up)
    print(f"soak {mode}: {done} tokens, RSS MiB per round " + ", ".join(f"{k / 1024:.1f}" for k in rss))
    assert growth < 8 * 1024, f"RSS grew by {growth / 1024:.1f} MiB over {done - 2 * ROUND} tokens: {rss}"
