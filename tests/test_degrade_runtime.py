"""DAOP's graceful degradation at inference (CacheConfig.degrade, `--degrade R`): the route policy of
edgemoe.policies.degrade run in the routing hook against what the expert cache holds."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from edgemoe.cli.main import cli
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def _run(path: Path, cache: CacheConfig | None) -> tuple[list[int], dict | None]:
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        if cache is not None:
            eng.enable_expert_cache(cache)
        toks = eng.generate(TEXT[:80], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        return toks, (dict(eng.experts.stats(), **eng.experts.report()) if eng.experts is not None else None)


def test_degradation_moves_cpu_experts_to_resident_ones(fixture_model: Path) -> None:
    """r = 1 replaces only exact ties (none here): the tokens are stock's through the hook. A smaller r
    replaces some of the decode tokens' CPU experts by resident ones: more of the routed slots hit the
    cache, and the report counts what it avoided."""
    stock, _ = _run(fixture_model, None)
    same, st1 = _run(fixture_model, CacheConfig(8, policy=LruConfig(), degrade=1.0))
    assert same == stock and st1 is not None and st1["degrade"]["replaced"] == 0 < st1["degrade"]["cpu"]
    _, st = _run(fixture_model, CacheConfig(8, policy=LruConfig(), degrade=0.5))
    assert st is not None
    d = st["degrade"]
    assert 0 < d["replaced"] <= d["cpu"] <= d["routed"] and d["cpu_avoided"] == d["replaced"] / d["cpu"]
    assert st["decode_hit_rate"] > st1["decode_hit_rate"]


def test_cli_degrade_reports_and_is_refused_without_a_cache(fixture_model: Path) -> None:
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "ROMEO:", "-n", "8", "--expert-slots", "8",
                                 "--degrade", "0.5", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["cache"]["degrade"]["ratio"] == 0.5 and out["cache"]["degrade"]["routed"] > 0
    assert out["control"]["n_host_syncs"] > 0  # it runs in the routing hook
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "x", "--degrade", "0.5"])
    assert r.exit_code != 0 and "give --vram or --expert-slots" in r.output
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "x", "--expert-slots", "8", "--degrade", "1.5"])
    assert r.exit_code != 0 and "1.5" in r.output
