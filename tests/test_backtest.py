"""The performance model's backtest against published measurements: the table in docs regenerates, its
statistics are computed from the rows, and every row names a source, a bundled profile and a known shape."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgemoe.perf.backtest import Published, backtest, error_stats, load_published, markdown
from edgemoe.perf.profile import bundled_profiles
from edgemoe.perf.shapes import shape_preset

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance-model.md"


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


def test_docs_table_regenerates(projections):
    text = DOC.read_text()
    body = text.split("<!-- backtest:begin -->\n", 1)[1].split("<!-- backtest:end -->", 1)[0]
    assert body == markdown(projections)


def test_error_stats_are_computed_from_the_rows(projections):
    stats = error_stats(projections)
    for kind in ("stock", "cache"):
        errs = sorted(abs(p.projected_tps / p.row.published_tps - 1.0) for p in projections if p.row.kind == kind)
        mid = len(errs) // 2
        median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
        assert stats[kind]["median_abs_error"] == pytest.approx(median)
        assert stats[kind]["rows"] == len(errs)
    line = next(ln for ln in markdown(projections).splitlines() if ln.startswith("- **stock rows**"))
    assert re.search(rf"median absolute error {100 * stats['stock']['median_abs_error']:.0f}%", line)


def test_projection_follows_the_published_configuration(tmp_path):
    """More experts on the GPU projects faster on the same machine; a bigger LRU cache hits more often."""
    base = dict(kind="stock", model="qwen3-30b-a3b", quant="Q4_K_M", profile="rtx2080-i9-10900x",
                published_tps=1.0, source="test", conditions="test")
    rows = [Published(id="all-cpu", n_cpu_moe=99, **base), Published(id="half", n_cpu_moe=24, **base),
            Published(**{**base, "kind": "cache"}, id="lru8", n_cpu_moe=99, policy="lru", slots=8, miss="load"),
            Published(**{**base, "kind": "cache"}, id="lru64", n_cpu_moe=99, policy="lru", slots=64, miss="load")]
    all_cpu, half, lru8, lru64 = backtest(rows, tmp_path)
    assert half.projected_tps > all_cpu.projected_tps
    assert lru64.projected_hit_rate > lru8.projected_hit_rate
    assert lru64.projected_tps > lru8.projected_tps
