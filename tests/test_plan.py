"""`edgemoe plan`: the budget's split, equal and DP slots per MoE layer, expected hit rates and speeds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemoe.calibration.adaptive import default_calibration_dir
from edgemoe.cli import cli
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.model.layouts import make_layouts, suggest
from edgemoe.perf.model.profile import load_profile
from edgemoe.perf.model.simulate import SimSpec, simulate
from edgemoe.plan.reserve import budget_for_slots

from helpers.models import FIXTURE_MODELS

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)


def test_plan_splits_the_budget_and_allocates_dp_slots_within_it() -> None:
    info = read_model_info(QWEN)
    vram = budget_for_slots(info, 8, 512)
    plan = make_layouts(QWEN, vram=vram, n_ctx=512, calibration=default_calibration_dir(QWEN),
                     profile=load_profile("rtx4060-laptop"))
    assert plan.slots_per_layer["equal"] == [8] * len(info.moe_layers)
    dp = plan.slots_per_layer["dp"]
    assert dp is not None and len(dp) == len(info.moe_layers)
    left = vram - plan.fits["dense"] - plan.fits["kv_cache"] - plan.fits["reserve"]
    per = info.bytes_per_expert_by_layer
    assert sum(n * per[il] for n, il in zip(dp, info.moe_layers, strict=False)) <= left  # the same budget as equal's
    assert sum(dp) != 8 * len(dp) or dp != plan.slots_per_layer["equal"]  # dp decided something
    assert sum(plan.fits.values()) <= vram
    rows = {(r["config"], r["allocation"]): r for r in plan.expected}
    assert ("edgemoe-lru", "equal") in rows and ("edgemoe-lru", "dp") in rows
    assert ("edgemoe-daop", "equal") in rows and ("edgemoe-daop", "dp") in rows  # every policy the model replays
    assert any("promoe" in n for n in plan.notes)  # and the one it does not, said
    assert all(0.0 < r["hit_rate"] <= 1.0 for r in plan.expected if r["allocation"])
    assert all(r["decode_tps"] > 0 and r["projected"] for r in plan.expected)
    assert "in-sample" in plan.routing
    # the edgemoe rows are projected as the build runs them with a cache on a GPU: branches overlapped
    ref = simulate(QWEN, _calibration_trace_of(QWEN), load_profile("rtx4060-laptop"),
                   SimSpec(vram=vram, n_ctx=512, policies=("lru",), calibration=default_calibration_dir(QWEN),
                           overlap=True))
    lru = next(c for c in ref.configs if c.name == "edgemoe-lru")
    assert rows[("edgemoe-lru", "equal")]["decode_tps"] == lru.decode_tps
    sg = plan.suggestion
    assert sg is not None and sg["projected"]
    ours = [r for r in plan.expected if r["allocation"]]
    assert sg["decode_tps"] == max(r["decode_tps"] for r in ours)
    assert sg["stock_decode_tps"] == max(r["decode_tps"] for r in plan.expected if not r["allocation"])
    assert sg["vs_stock"] == sg["decode_tps"] / sg["stock_decode_tps"]
    assert sg["stock_faster"] == (sg["vs_stock"] <= 1.0)


def _calibration_trace_of(model: Path):  # type: ignore[no-untyped-def]
    from edgemoe.perf.model.layouts import _calibration_trace

    return _calibration_trace(default_calibration_dir(model), read_model_info(model))


def test_suggest_names_the_fastest_edgemoe_row_and_its_command() -> None:
    rows = [{"config": "stock-ot-exps-cpu", "allocation": None, "decode_tps": 9.5},
            {"config": "stock-n-cpu-moe-24", "allocation": None, "decode_tps": 11.4},
            {"config": "edgemoe-lru", "allocation": "equal", "decode_tps": 3.2},
            {"config": "edgemoe-static", "allocation": "dp", "decode_tps": 15.0},
            {"config": "edgemoe-dali", "allocation": "equal", "decode_tps": 10.3}]
    sg = suggest(rows, model="my models/m.gguf", vram=8 * 2**30, n_ctx=4096)
    assert sg is not None and not sg["stock_faster"]
    assert (sg["config"], sg["allocation"], sg["stock"]) == ("edgemoe-static", "dp", "stock-n-cpu-moe-24")
    assert abs(sg["vs_stock"] - 15.0 / 11.4) < 1e-12
    assert sg["command"] == ("edgemoe chat 'my models/m.gguf' --vram 8GiB --ctx 4096 --policy static --alloc dp")
    slow = suggest(rows[:3], model="m.gguf", vram=3 * 2**29, n_ctx=512)
    assert slow is not None and slow["stock_faster"] and slow["config"] == "edgemoe-lru"
    assert "--vram 1536MiB" in slow["command"]
    assert suggest(rows[2:], model="m.gguf", vram=2**30, n_ctx=512) is None  # no stock row: nothing to compare
    assert suggest([{"config": "edgemoe-lru", "allocation": "equal", "hit_rate": 0.5}], model="m.gguf",
                   vram=2**30, n_ctx=512) is None  # hit rates only


def test_plan_without_routing_data_or_room_says_what_to_do(tmp_path: Path) -> None:
    small = make_layouts(QWEN, vram=64 * 2**20, n_ctx=512)
    assert small.slots_per_layer["equal"] == [0] * len(read_model_info(QWEN).moe_layers) and any("raise `vram`" in n for n in small.notes)


def test_plan_cli(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["plan", str(QWEN), "--expert-slots", "8", "--ctx", "512", "--profile",
                                 "rtx4090-desktop", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d["slots_per_layer"]) == {"equal", "dp"} and len(d["slots_per_layer"]["equal"]) == 8
    text = CliRunner().invoke(cli, ["plan", str(QWEN), "--vram", "520MiB", "--ctx", "512", "--profile",
                                    "rtx4060-laptop"], catch_exceptions=False).output
    assert "slots per MoE layer, equal" in text and "PROJECTED" in text
    assert "PROJECTED fastest decode: " in text  # the suggestion, with the profile's speeds
    assert d["suggestion"]["command"].startswith(f"edgemoe chat {QWEN} --vram ")
    bad = CliRunner().invoke(cli, ["plan", str(QWEN)])
    assert bad.exit_code != 0 and "--vram" in bad.output
    both = CliRunner().invoke(cli, ["plan", str(QWEN), "--vram", "1GiB", "--expert-slots", "4"])
    assert both.exit_code == 2 and "not both" in both.output


def _uncalibrated(tmp_path: Path, preset: str, layers: int) -> Path:
    from edgemoe.gguf.synth import write_synthetic

    return write_synthetic(preset, tmp_path / f"{preset}.gguf", layers=layers, shape_only=True, progress=False)


@pytest.mark.long  # a projection per policy: the long suite (`make test-long`)
def test_plan_without_routing_data_projects_with_the_matching_routing_profile(tmp_path: Path) -> None:
    """A model with no trace and no calibration gets the bundled routing profile of its shape, named."""
    model = _uncalibrated(tmp_path, "qwen3-30b-a3b", 6)
    assert default_calibration_dir(model) is None
    r = CliRunner().invoke(cli, ["plan", str(model), "--vram", "1GiB", "--ctx", "512", "--profile", "rtx4060-laptop",
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["routing_profile"] == "qwen3-30b-a3b" and "bundled routing profile qwen3-30b-a3b" in d["routing"]
    rows = {x["config"] for x in d["expected"]}
    assert {"edgemoe-lru", "edgemoe-static", "stock-ot-exps-cpu"} <= rows
    assert all(x["decode_tps"] > 0 for x in d["expected"]) and d["suggestion"] is not None
    # a shape no profile has takes the nearest real model's, and says so; --routing picks one
    oss = _uncalibrated(tmp_path, "gpt-oss-20b", 2)
    plan = make_layouts(oss, vram=2 * 2**30, n_ctx=512)
    assert plan.routing_profile == "olmoe-1b-7b" and "nearest shape" in plan.routing and plan.expected
    toy = make_layouts(oss, vram=2 * 2**30, n_ctx=512, routing="fixture-qwen3moe")
    assert toy.routing_profile == "fixture-qwen3moe" and any("TOY" in n for n in toy.notes)
    both = CliRunner().invoke(cli, ["plan", str(oss), "--vram", "1GiB", "--routing", "olmoe", "--trace", __file__])
    assert both.exit_code == 2 and "not both" in both.output


def test_simulate_without_a_trace_uses_the_routing_profile(tmp_path: Path) -> None:
    model = _uncalibrated(tmp_path, "mixtral-8x7b", 3)
    r = CliRunner().invoke(cli, ["simulate", str(model), "--profile", "rtx4060-laptop", "--vram", "6GiB", "--ctx",
                                 "512", "--policy", "lru", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["routing_profile"] == "mixtral-8x7b" and "its shape" in d["routing"]
    text = CliRunner().invoke(cli, ["simulate", str(model), "--profile", "rtx4060-laptop", "--vram", "6GiB",
                                    "--ctx", "512", "--policy", "lru", "--routing", "olmoe"],
                              catch_exceptions=False).output
    assert text.startswith("routing: bundled routing profile olmoe-1b-7b (the nearest shape")
    gated = CliRunner().invoke(cli, ["simulate", str(model), "--profile", "rtx4060-laptop", "--gating", "ser",
                                     "--threshold", "0.4"])
    assert gated.exit_code == 2 and "recorded --trace" in gated.output


def test_plan_says_when_the_budget_holds_the_whole_model() -> None:
    plan = make_layouts(QWEN, vram=2**30, n_ctx=512, calibration=default_calibration_dir(QWEN),
                     profile=load_profile("rtx4060-laptop"))
    assert plan.slots_per_layer["equal"] == [read_model_info(QWEN).n_expert] * len(read_model_info(QWEN).moe_layers)
    assert plan.suggestion is None and any("holds the whole model" in n for n in plan.notes)


def test_vram_auto_is_the_gpus_free_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """--vram auto: the free memory of this build's GPU (faked here: this machine has none), said on stderr; a build
    without a GPU refuses it with what to do."""
    from edgemoe.runtime import native

    args = ["plan", str(QWEN), "--vram", "auto", "--ctx", "512", "--json"]
    none = CliRunner().invoke(cli, args)
    assert none.exit_code == 2 and "this build has no GPU" in none.output and "8GiB" in none.output
    monkeypatch.setattr(native, "gpu_device", lambda: 1234)
    monkeypatch.setattr(native, "device_memory", lambda dev: (515 * 2**20, 8 * 2**30))
    monkeypatch.setattr(native, "device_name", lambda dev: "Fake RTX")
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "--vram auto: 515.0 MiB free on Fake RTX" in res.stderr
    assert json.loads(res.stdout)["budget_bytes"] == 515 * 2**20
