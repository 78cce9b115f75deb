"""The performance model's backtest against published measurements: the table in docs regenerates, its
statistics are computed from the rows, and every row names a source, a bundled profile and a known shape."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgemoe.perf.model.backtest import Published, backtest, error_stats, load_published, markdown
from edgemoe.perf.model.profile import bundled_profiles
from edgemoe.perf.model.shapes import shape_preset

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "research" / "performance-model.md"


@pytest.fixture(scope="module")
def projections(tmp_path_factory):
    return backtest(load_published(), tmp_path_factory.mktemp("shapes"))


def test_rows_are_sourced_and_resolvable():
    rows = load_published()
    assert len(rows) >= 12
    assert {r.kind for r in rows} == {"stock", "cache"}
    profiles = bundled_profiles()
    for r in rows:
        assert r.source and r.conditions and r.published_tps > 0
        assert r.profile in profiles, r.id
        assert shape_preset(r.model).n_expert > 0
        if r.kind == "cache":
            assert r.policy in ("lru", "static") and r.slots > 0 and r.miss in ("cpu", "load")
    assert len({r.id for r in rows}) == len(rows)


@pytest.mark.long  # the decode backtest's docs table: the long suite (`make test-long`)
def test_docs_table_regenerates(projections):
    text = DOC.read_text()
    body = text.split("<!-- backtest:begin -->\n", 1)[1].split("<!-- backtest:end -->", 1)[0]
    assert body == markdown(projections)


def test_error_stats_are_computed_from_the_rows(projections):
    stats = error_stats(projections)
    for kind in ("stock", "cache"):
        errs = sorted(abs(p.projected_tps / p.row.published_tps - 1.0)
                      for p in projections if p.row.kind == kind)
        mid = len(errs) // 2
        median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
        assert stats[kind]["median_abs_error"] == pytest.approx(median)
        assert stats[kind]["rows"] == len(errs)
    line = next(ln for ln in markdown(projections).splitlines() if ln.startswith("- **stock rows**"))
    assert re.search(rf"median absolute error {100 * stats['stock']['median_abs_error']:.1f}%", line)


def test_backtest_meets_the_error_targets(projections):
    """The backtest's targets: median absolute error at most 20% on the stock rows, 25% on the cache rows."""
    for kind, s in error_stats(projections).items():
        assert s["median_abs_error"] <= s["target"], (kind, s)


def test_pageable_host_routed_misses_cost_their_copies(tmp_path):
    """A fork that copies each miss from pageable memory and reads each layer's routing on the host is slower
    than one that copies from pinned memory on its own, by the slower copies and a link latency per cached
    layer."""
    from edgemoe.perf.model.costmodel import ModelShape
    from edgemoe.perf.model.profile import load_profile
    from edgemoe.perf.model.shapes import shape_file, with_k_m_mix

    base = {"kind": "cache", "model": "qwen3-30b-a3b", "quant": "Q4_K_M", "profile": "rtx5090-wsl2",
            "published_tps": 1.0, "source": "test", "conditions": "test", "n_cpu_moe": 99, "policy": "lru",
            "slots": 24, "miss": "load"}
    pinned, pageable = backtest([Published(id="pinned", **base),
                                 Published(id="pageable", pageable_misses=True, host_routed=True, **base)],
                                tmp_path)
    assert pageable.projected_hit_rate == pinned.projected_hit_rate
    shape = with_k_m_mix(ModelShape.read(shape_file("qwen3-30b-a3b", "Q4_K", tmp_path)), "Q4_K_M")
    link = load_profile("rtx5090-wsl2").link
    per_miss = sum(shape.expert_bytes(il) for il in shape.moe_layers) / len(shape.moe_layers)
    misses = 48 * 8 * (1.0 - pinned.projected_hit_rate)
    expected = misses * per_miss * (1 / link.h2d_pageable - 1 / link.h2d_pinned) + 48 * link.latency_s
    extra = 1 / pageable.projected_tps - 1 / pinned.projected_tps
    assert extra == pytest.approx(expected, rel=0.2)


def test_k_m_mix_puts_half_the_down_projections_in_q6_k(tmp_path):
    from edgemoe.perf.model.costmodel import ModelShape
    from edgemoe.perf.model.shapes import shape_file, with_k_m_mix

    plain = ModelShape.read(shape_file("qwen3-30b-a3b", "Q4_K", tmp_path))
    mixed = with_k_m_mix(plain, "Q4_K_M")
    downs = [mixed.layer(il).expert[2].qtype for il in mixed.moe_layers]
    assert downs.count("Q6_K") == 24 and set(downs) == {"Q4_K", "Q6_K"}
    assert with_k_m_mix(plain, "Q4_K") is plain
    il = next(il for il in mixed.moe_layers if mixed.layer(il).expert[2].qtype == "Q6_K")
    assert mixed.expert_bytes(il) / plain.expert_bytes(il) == pytest.approx((144 * 2 + 210) / (144 * 3))


def test_projection_follows_the_published_configuration(tmp_path):
    """More experts on the GPU projects faster on the same machine; a bigger LRU cache hits more often."""
    base = {"kind": "stock", "model": "qwen3-30b-a3b", "quant": "Q4_K_M", "profile": "rtx2080-i9-10900x",
            "published_tps": 1.0, "source": "test", "conditions": "test"}
    cache = {**base, "kind": "cache", "n_cpu_moe": 99, "policy": "lru", "miss": "load"}
    rows = [Published(id="all-cpu", n_cpu_moe=99, **base), Published(id="half", n_cpu_moe=24, **base),
            Published(**{**cache, "id": "lru8", "slots": 8}), Published(**{**cache, "id": "lru64", "slots": 64})]
    all_cpu, half, lru8, lru64 = backtest(rows, tmp_path)
    assert half.projected_tps > all_cpu.projected_tps
    assert lru64.projected_hit_rate > lru8.projected_hit_rate
    assert lru64.projected_tps > lru8.projected_tps


# --------------------------------------------------------------------------- the prefill rows

@pytest.fixture(scope="module")
def prefill_projections(tmp_path_factory):
    from edgemoe.perf.model.backtest_prefill import backtest_prefill, load_published_prefill

    return backtest_prefill(load_published_prefill(), tmp_path_factory.mktemp("prefill-shapes"))


def test_prefill_rows_are_sourced_and_resolvable():
    from edgemoe.perf.model.backtest_prefill import load_published_prefill

    rows = load_published_prefill()
    assert len(rows) >= 10 and len({r.id for r in rows}) == len(rows)
    assert any(r.n_ubatch >= 512 for r in rows) and any(r.n_ubatch < 512 for r in rows)
    for r in rows:
        assert r.source and r.conditions and r.published_tps > 0 and r.n_ubatch <= r.prompt_tokens
        assert r.profile in bundled_profiles(), r.id
        assert f"-ub {r.n_ubatch}" in r.conditions and f"pp{r.prompt_tokens}" in r.conditions


@pytest.mark.long  # the prefill backtest's docs table: the long suite (`make test-long`)
def test_prefill_docs_table_regenerates(prefill_projections):
    from edgemoe.perf.model.backtest_prefill import prefill_markdown

    body = DOC.read_text().split("<!-- backtest-prefill:begin -->\n", 1)[1].split("<!-- backtest-prefill:end -->")[0]
    assert body == prefill_markdown(prefill_projections)


def test_prefill_stats_are_computed_from_the_rows(prefill_projections):
    from edgemoe.perf.model.backtest_prefill import LARGE_UBATCH, prefill_error_stats

    stats = prefill_error_stats(prefill_projections)
    large = [p.error for p in prefill_projections if p.row.n_ubatch >= LARGE_UBATCH]
    assert stats["large_ubatch"]["rows"] == len(large) and stats["all"]["rows"] == len(prefill_projections)
    assert stats["large_ubatch"]["worst_error"] == max(large, key=abs)


def test_a_prefill_row_replays_the_whole_model_on_the_gpu(tmp_path):
    """The row's prompt in ubatches of its -ub, every expert resident: more tokens per ubatch is faster until the
    GPU's compute binds, and a model the GPU cannot hold is refused."""
    from edgemoe.perf.model.backtest_prefill import PublishedPrefill, backtest_prefill

    base = {"model": "qwen3-30b-a3b", "quant": "Q4_0", "profile": "rtx4090-desktop", "prompt_tokens": 1024,
            "published_tps": 1.0, "source": "test", "conditions": "test"}
    small, large = backtest_prefill([PublishedPrefill(id="a", n_ubatch=64, **base),
                                     PublishedPrefill(id="b", n_ubatch=1024, **base)], tmp_path)
    assert large.projected_tps > small.projected_tps and large.bound == "gpu"
    with pytest.raises(ValueError, match="not held whole"):
        backtest_prefill([PublishedPrefill(id="c", n_ubatch=512, **{**base, "profile": "rtx4060-laptop"})], tmp_path)
    # a dense model has no routing; a prompt after a deep KV cache attends over it
    dense = {**base, "model": "llama-3-8b", "prompt_tokens": 512}
    fresh, deep = backtest_prefill([PublishedPrefill(id="d", n_ubatch=256, **dense),
                                    PublishedPrefill(id="e", n_ubatch=256, depth=32768, **dense)], tmp_path)
    assert fresh.bound == deep.bound == "gpu" and deep.projected_tps < 0.8 * fresh.projected_tps


@pytest.mark.long  # the prefill backtest, refitted: the long suite (`make test-long`)
def test_prefill_fitted_table_regenerates(tmp_path_factory):
    from edgemoe.perf.model.backtest_prefill import (
        FITTED_RATES,
        backtest_prefill,
        load_published_prefill,
        prefill_markdown,
    )

    fitted = backtest_prefill(load_published_prefill(), tmp_path_factory.mktemp("fitted-shapes"), FITTED_RATES)
    text = DOC.read_text()
    body = text.split("<!-- backtest-prefill-fitted:begin -->\n", 1)[1].split("<!-- backtest-prefill-fitted:end -->")[0]
    assert body == prefill_markdown(fitted)


def test_kind_rates_price_the_experts_and_the_attention_apart():
    """A roofline's expert and attention rates (0: its flops) price those products alone; with_kind_rates scales
    each from the profile's flops and says so."""
    import dataclasses

    from edgemoe.perf.model.costmodel import LayerCosts, ModelShape
    from edgemoe.perf.model.profile import load_profile, with_kind_rates

    qwen = Path(__file__).resolve().parents[1] / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
    shape = ModelShape.read(qwen)
    prof = load_profile("rtx4060-laptop")
    assert prof.gpu is not None and prof.gpu.roofline.expert_flops == prof.gpu.roofline.attn_flops == 0.0
    fast = with_kind_rates(prof, dense=1.0, expert=2.0, attention=4.0)
    assert fast.gpu is not None and "experts 2x" in fast.name and "attention 4x" in fast.notes
    il = shape.moe_layers[0]
    big = 4096  # compute-bound: each product's time halves with twice its rate
    base, scaled = LayerCosts.of(prof.gpu, shape), LayerCosts.of(fast.gpu, shape)
    assert scaled.dense(il, big) == pytest.approx(base.dense(il, big))
    assert scaled.expert(il, big) == pytest.approx(base.expert(il, big) / 2)
    roof = dataclasses.replace(prof.gpu.roofline, mem_bw=1e30)  # the attention's flops term alone
    a0 = LayerCosts.of(dataclasses.replace(prof.gpu, roofline=roof), shape).attention(il, big, 8192)
    a1 = LayerCosts.of(dataclasses.replace(prof.gpu, roofline=dataclasses.replace(roof, attn_flops=4 * roof.flops)),
                       shape).attention(il, big, 8192)
    assert a1 == pytest.approx(a0 / 4)
    assert with_kind_rates(dataclasses.replace(prof, gpu=None), dense=2, expert=2, attention=2).gpu is None


def test_kind_rates_profile_tool_writes_a_loadable_scaled_profile(tmp_path):
    import subprocess
    import sys

    from edgemoe.perf.model.backtest_prefill import FITTED_RATES
    from edgemoe.perf.model.profile import load_profile

    out = tmp_path / "fitted.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "kind_rates_profile.py"), "rtx4060-laptop",
                          "--out", str(out)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    base, fitted = load_profile("rtx4060-laptop"), load_profile(out)
    assert base.gpu is not None and fitted.gpu is not None
    d, e, a = FITTED_RATES
    assert fitted.gpu.roofline.flops == pytest.approx(d * base.gpu.roofline.flops)
    assert fitted.gpu.roofline.expert_flops == pytest.approx(e * base.gpu.roofline.flops)
    assert fitted.gpu.roofline.attn_flops == pytest.approx(a * base.gpu.roofline.flops)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "kind_rates_profile.py"), "rtx4060-laptop",
                          "--out", str(out), "--rates", "1,2"], capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "three numbers" in bad.stderr
