"""Bundled routing profiles of real models: each reproduces the published figures it was calibrated on within
the tolerance its file states, `trace-synth` writes their traces, and `trace-stats` reads the reuse back."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.routing_profile import (
    bundled_names,
    evaluate_targets,
    load_routing_profile,
    profile_for_shape,
)
from edgemoe.analysis.trace import Trace
from edgemoe.analysis.trace_stats import compute_stats
from edgemoe.cli import cli
from edgemoe.errors import EdgeMoeError

REAL = [n for n in bundled_names() if not load_routing_profile(n).toy]


def test_the_issue_s_profiles_are_bundled() -> None:
    assert {"qwen3-30b-a3b", "qwen3.8-flash-next", "mixtral-8x7b", "olmoe-1b-7b"} <= set(REAL)
    assert load_routing_profile("fixture-qwen3moe").toy and load_routing_profile("olmoe").name == "olmoe-1b-7b"


@pytest.mark.parametrize("name", REAL)
def test_profile_reproduces_its_published_figures(name: str) -> None:
    prof = load_routing_profile(name)
    assert prof.targets and all(s["link"].startswith("https://") for s in prof.doc["sources"])
    checks = evaluate_targets(prof, n_layer=6)
    bad = [f"{c.metric}: {c.measured:.3f} vs published {c.published:.3f} +- {c.tolerance} ({c.source})"
           for c in checks if not c.ok]
    assert not bad, bad


def test_qwen3_30b_profile_is_as_local_as_the_real_model() -> None:
    """The profile is as local as the real model (reuse within 8 tokens, LRU hit rate), through trace-stats' own
    statistics on a trace of four 512-token prompts."""
    tr = load_routing_profile("qwen3-30b-a3b").synthesize(n_layer=8, n_seq=4, prefill=256, decode=256, seed=1)
    d = compute_stats(tr, lru_sizes=[24]).to_dict()
    assert 0.72 <= d["reuse_within_8"] <= 0.88
    assert 0.66 <= d["lru_hit_rate_mean"][0] <= 0.80
    # the fixtures' toy routing, drawn at the same shape, is far less local: the checks above can fail
    toy = load_routing_profile("fixture-qwen3moe").synthesize(n_expert=128, k=8, n_layer=8, n_seq=4, prefill=256,
                                                              decode=256, seed=1)
    t = compute_stats(toy, lru_sizes=[24]).to_dict()
    assert t["reuse_within_8"] < 0.72 and t["lru_hit_rate_mean"][0] < 0.66


def test_profile_for_shape_matches_or_takes_the_nearest_real_model() -> None:
    assert profile_for_shape(128, 8) == (load_routing_profile("qwen3-30b-a3b"), True)
    assert profile_for_shape(8, 2)[0].name == "mixtral-8x7b"
    near, exact = profile_for_shape(32, 4)  # gpt-oss-20b's shape: no bundled profile; never the toy fixture
    assert not exact and not near.toy
    with pytest.raises(EdgeMoeError, match="choose one of"):
        load_routing_profile("no-such-model")


def test_synthesized_traces_name_their_routing_and_keep_the_shape() -> None:
    tr = load_routing_profile("mixtral-8x7b").synthesize(n_expert=16, k=4, n_layer=3, n_seq=2, prefill=5, decode=7)
    assert tr.ids.shape == (24, 3, 4) and tr.meta["routing"] == "mixtral-8x7b" and not tr.meta["routing_toy"]
    assert all(len(set(r)) == 4 for r in tr.ids.reshape(-1, 4).tolist()) and tr.ids.max() < 16
    assert (tr.phase[:5] == 0).all() and (tr.phase[5:12] == 1).all() and tr.seq.tolist() == [0] * 12 + [1] * 12
    with pytest.raises(EdgeMoeError, match="routing shape"):
        load_routing_profile("olmoe").synthesize(n_expert=4, k=8)


@pytest.mark.parametrize("name", bundled_names())
def test_trace_synth_and_trace_stats_cli(name: str, tmp_path: Path) -> None:
    out = tmp_path / "t.npz"
    r = CliRunner().invoke(cli, ["trace-synth", "--routing", name, "--tokens", "300", "--seq-len", "150",
                                 "--layers", "3", "--seed", "2", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    tr = Trace.load(out)
    again = tmp_path / "again.npz"
    CliRunner().invoke(cli, ["trace-synth", "--routing", name, "--tokens", "300", "--seq-len", "150", "--layers", "3",
                             "--seed", "2", "--out", str(again)], catch_exceptions=False)
    np.testing.assert_array_equal(Trace.load(again).ids, tr.ids)  # a seed draws the same trace
    prof = load_routing_profile(name)
    assert tr.ids.shape == (300, 3, prof.k) and tr.meta["routing"] == name and tr.n_expert == prof.n_expert
    sizes = sorted({prof.k, min(prof.n_expert, 2 * prof.k)})
    r = CliRunner().invoke(cli, ["trace-stats", str(out), "--json", "--lru-sizes", ",".join(map(str, sizes))],
                           catch_exceptions=False)
    d = json.loads(r.output)
    assert d["lru_sizes"] == sizes and len(d["lru_hit_rate_mean"]) == len(sizes) and d["trace"]["routing"] == name
    assert 0.0 < d["reuse_next"] < d["reuse_within_8"] <= 1.0
    np.testing.assert_allclose(d["lru_hit_rate_mean"], np.mean(d["lru_hit_rate"], axis=0), atol=1e-4)
    r = CliRunner().invoke(cli, ["trace-stats", str(out), "--lru-sizes", str(prof.n_expert + 1)])
    assert r.exit_code != 0 and "sizes up to" in r.output
