"""edgemoe bench on a fixture (CPU: the GPU configurations collapse to the CPU stand-in)."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from edgemoe.cli import cli
from edgemoe.gguf.info import read_model_info
from edgemoe.plan.budget import best_n_cpu_moe

from helpers.models import FIXTURE_MODELS


def _rows(args: list[str]) -> dict[str, dict]:
    """bench's rows by name from a --json run that must succeed."""
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return {r["name"]: r for r in json.loads(res.stdout[res.stdout.index("{"):])["rows"]}


def test_bench_cli_runs_every_configuration(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    res = CliRunner().invoke(cli, ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens", "48",
                                   "--gen-tokens", "8", "-t", "2", "--json", "--plot", str(png),
                                   "--profile", "none"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    names = [r["name"] for r in out["rows"]]
    assert names == ["stock -ot exps=CPU", "edgemoe lru dp", "edgemoe static dp"]  # the fixture's calibration
    assert 0 < out["slots_per_layer"] < read_model_info(FIXTURE_MODELS[0]).n_expert  # what the budget leaves
    for r in out["rows"]:
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["ttft_s"] > 0, r
        assert r["reuse_ttft_s"] > 0  # a second request on the prefix ran (its speed-up: on 8K prompts)
        assert r["ratio_decode"] is not None
    assert out["rows"][0]["ratio_decode"] == 1.0
    assert out["rows"][1]["cache"]["hits"] > 0
    assert png.stat().st_size > 1000
    assert all(r["projected_decode_tps"] is None for r in out["rows"])


def test_bench_prints_the_projection_beside_the_measurement() -> None:
    """With a profile, the rows the model covers get a projection and its error (on a CPU: stock only; the
    stand-in cache is no device a user has)."""
    res = CliRunner().invoke(cli, ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens", "48",
                                   "--gen-tokens", "8", "-t", "2", "--policy", "lru", "--profile", "rtx4060-laptop",
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    stock, lru = out["rows"]
    assert stock["projected_decode_tps"] > 0 and stock["projected_prefill_tps"] > 0
    assert stock["projection_error"] == stock["projected_decode_tps"] / stock["decode_tps"] - 1
    assert lru["projected_decode_tps"] is None
    assert "rtx4060-laptop" in out["projection_note"]
    table = CliRunner().invoke(cli, ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens", "48",
                                     "--gen-tokens", "8", "-t", "2", "--policy", "lru", "--profile",
                                     "rtx4060-laptop"], catch_exceptions=False).output
    assert "proj dec" in table and "PROJECTED" in table


def test_bench_alloc_equal_and_dali() -> None:
    res = CliRunner().invoke(cli, ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens",
                                   "32", "--gen-tokens", "4", "-t", "2", "--json", "--alloc", "equal",
                                   "--policy", "dali"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    row = out["rows"][-1]
    assert row["name"] == "edgemoe dali" and row["cache"]["hits"] > 0
    assert set(row["cache"]["slots_per_layer"].values()) == {out["slots_per_layer"]}


def test_bench_daop() -> None:
    """daop in bench: its row runs (the calibration's decode counts place it; the prompt swaps it)."""
    res = CliRunner().invoke(cli, ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens",
                                   "32", "--gen-tokens", "4", "-t", "2", "--json", "--alloc", "equal",
                                   "--policy", "daop", "--profile", "none"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    row = out["rows"][-1]
    assert row["name"] == "edgemoe daop" and row["cache"]["hits"] > 0 and row["decode_tps"] > 0


def test_best_n_cpu_moe_is_the_fewest_layers_that_fit() -> None:
    info = read_model_info(FIXTURE_MODELS[0])
    per_layer = info.bytes_per_expert_by_layer[0] * info.n_expert
    from edgemoe.plan.budget import estimate_kv_cache_bytes
    from edgemoe.plan.reserve import VRAM_RESERVE, reserve_bytes

    reserve = reserve_bytes(info, 256)
    assert reserve == VRAM_RESERVE
    fixed = best_n_cpu_moe(info, 10**12, 256, reserve_bytes=reserve)
    assert fixed == 0  # everything fits
    n_layers = len(info.moe_layers)
    base = info.dense_bytes + estimate_kv_cache_bytes(info, 256) + VRAM_RESERVE
    assert best_n_cpu_moe(info, base + 3 * per_layer, 256, reserve_bytes=reserve) == n_layers - 3
    assert best_n_cpu_moe(info, base - 1, 256, reserve_bytes=reserve) is None


def test_bench_assign_rows() -> None:
    """--assign adds an lru row with the CPU/GPU assigner, priced by a GPU profile (not projected: the model
    has no per-token assignment); without a GPU profile it is refused."""
    args = ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens", "48", "--gen-tokens", "8",
            "-t", "2", "--json", "--policy", "lru", "--alloc", "equal", "--assign", "ratio"]
    rows = _rows([*args, "--profile", "rtx4060-laptop"])
    assert set(rows) == {"stock -ot exps=CPU", "edgemoe lru", "edgemoe lru +assign ratio"}
    a = rows["edgemoe lru +assign ratio"]
    assert a["decode_tps"] > 0 and a["cache"]["hits"] > 0 and a["projected_decode_tps"] is None
    res = CliRunner().invoke(cli, [*args, "--profile", "none"])
    assert res.exit_code != 0 and "--profile" in res.output


def test_bench_device_prefill_rows() -> None:
    """--device-prefill adds a policy row whose prompt ran from the prefill buffers, with fewer or as many slots
    (the buffers come out of the budget)."""
    args = ["bench", str(FIXTURE_MODELS[0]), "--vram", "560MiB", "--prompt-tokens", "48", "--gen-tokens", "8",
            "-t", "2", "--json", "--policy", "lru", "--alloc", "equal", "--device-prefill", "16", "--profile", "none"]
    rows = _rows(args)
    assert set(rows) == {"stock -ot exps=CPU", "edgemoe lru", "edgemoe lru +device prefill"}
    pf = rows["edgemoe lru +device prefill"]
    assert pf["decode_tps"] > 0 and pf["cache"]["slots_total"] <= rows["edgemoe lru"]["cache"]["slots_total"], pf
    assert "beside the prefill buffers" in pf["note"] and pf["cache"]["prefill"]["ubatches"] >= 1, pf
    assert rows["edgemoe lru"]["cache"]["prefill"] is None


def test_bench_precalc_rows() -> None:
    """--precalc-from adds a policy row with DAOP's pre-calculation (its counters in cache.precalc); a layer that
    leaves nothing to pre-calculate is a usage error. On a GPU the row is projected at the rates it measured
    (its Projection, checked here on a made-up trace)."""
    args = ["bench", str(FIXTURE_MODELS[0]), "--vram", "520MiB", "--prompt-tokens", "32", "--gen-tokens", "8",
            "-t", "2", "--json", "--policy", "static", "--alloc", "equal", "--profile", "none"]
    rows = _rows([*args, "--precalc-from", "5"])
    assert set(rows) == {"stock -ot exps=CPU", "edgemoe static", "edgemoe static +precalc 5"}
    pc = rows["edgemoe static +precalc 5"]
    assert pc["decode_tps"] > 0 and pc["cache"]["precalc"]["computed"] > 0, pc
    assert pc["cache"]["precalc"]["first_layer"] == 5 and rows["edgemoe static"]["cache"].get("precalc") is None
    n_layer = read_model_info(FIXTURE_MODELS[0]).n_layer
    bad = CliRunner().invoke(cli, [*args, "--precalc-from", str(n_layer)])
    assert bad.exit_code != 0 and "--precalc-from" in bad.output

    from edgemoe.gguf.header import check_gguf
    from edgemoe.perf.bench.project import projections
    from edgemoe.perf.bench.records import BenchRow, Projection, RowResult
    from edgemoe.perf.model.profile import load_profile
    from edgemoe.perf.model.simulate import SimSpec
    from edgemoe.plan import plan

    from helpers.traces import skewed_trace

    trace = skewed_trace(FIXTURE_MODELS[0], n_seq=2, prefill=16, decode=16)
    base = SimSpec(vram=520 * 2**20, n_ctx=256, n_ubatch=512, warmup_seqs=1, policies=("static",), overlap=True)
    placement = plan(check_gguf(FIXTURE_MODELS[0]), None, n_ctx=256, device=None)
    proj = Projection("edgemoe-static-precalc", 512, policies=("static",), precalc_from=5)
    row = BenchRow("edgemoe static +precalc 5", "edgemoe", placement, projection=proj)
    measured = RowResult(row.name, "edgemoe", 1.0, 1.0, 1.0, 1.0, None,
                         cache={"precalc": {"early_share": 0.8, "precision": 0.75}})
    prof = load_profile("rtx4060-laptop")
    found, _ = projections([row], [measured], FIXTURE_MODELS[0], trace, prof, base)
    assert found[row.name].name == "edgemoe-static-precalc" and found[row.name].decode_tps > 0
    unmeasured = RowResult(row.name, "edgemoe", 1.0, 1.0, 1.0, 1.0, None, cache={"precalc": {}})
    assert projections([row], [unmeasured], FIXTURE_MODELS[0], trace, prof, base)[0] == {}
