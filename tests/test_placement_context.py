"""edgemoe.plan.context: the context length x KV type -> expert slots table of a budget, the context the plan
picks when none is asked, and where inspect, plan and the opening commands show them."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemoe.cli import cli
from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.info import ModelInfo, read_model_info
from edgemoe.gguf.kv_types import KvTypes
from edgemoe.placement import budget_request, cache_request, plan
from edgemoe.plan.budget import slot_budget
from edgemoe.plan.context import KEEP_SLOTS, TABLE_CTX, context_table, default_context, format_context_table
from edgemoe.plan.reserve import budget_for_slots, reserve_bytes

from helpers.models import FIXTURE_MODELS

QWEN_FIXTURE = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
F16 = KvTypes()


@pytest.fixture(scope="module")
def qwen30b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-30B-A3B shape in 12 of its 48 layers (the tests run faster), its tensors holes of zeros (no disk
    space): trained for 40960 tokens."""
    from edgemoe.gguf.synth import write_synthetic

    out = tmp_path_factory.mktemp("ctx") / "qwen3-30b-a3b-12.gguf"
    return write_synthetic("qwen3-30b-a3b", out, layers=12, shape_only=True, progress=False)


@pytest.fixture(scope="module")
def info(qwen30b: Path) -> ModelInfo:
    return read_model_info(qwen30b)


def _budget(info: ModelInfo, slots: int) -> int:
    return budget_for_slots(info, slots, 4096)


def test_slots_fall_as_the_context_grows_and_a_quantized_cache_gives_some_back(info: ModelInfo) -> None:
    table = context_table(info, _budget(info, 100))
    assert table is not None and info.n_ctx_train == 40960
    assert [r.n_ctx for r in table.rows[::3]] == [4096, 16384, 32768]  # 64K and 128K are past training
    assert [r.kv_type for r in table.rows[:3]] == ["f16", "q8_0", "q4_0"]
    by = {(r.n_ctx, r.kv_type): r for r in table.rows}
    assert by[(4096, "f16")].slots_per_layer == 100  # what plan() leaves at that context
    for kind in ("f16", "q8_0", "q4_0"):
        slots = [by[(c, kind)].slots_per_layer for c in (4096, 16384, 32768)]
        assert slots == sorted(slots, reverse=True) and slots[0] > slots[-1]
    for c in (4096, 16384, 32768):
        assert by[(c, "q4_0")].slots_per_layer >= by[(c, "q8_0")].slots_per_layer > by[(c, "f16")].slots_per_layer
        assert by[(c, "q8_0")].kv_cache_bytes * 16 == by[(c, "f16")].kv_cache_bytes * 8.5
    assert [r.needs_flash_attn for r in table.rows[:3]] == [False, True, True]
    # each row's slots are the budget arithmetic's at that context and type
    sb = slot_budget(info, table.budget_bytes, n_ctx=16384, reserve_bytes=reserve_bytes(info, 16384),
                     kv=KvTypes("q8_0", "q8_0"))
    assert by[(16384, "q8_0")].slots_per_layer == sb.experts_per_layer


def test_rows_past_the_training_context_are_absent(info: ModelInfo) -> None:
    vram = _budget(info, 100)
    assert {r.n_ctx for r in context_table(info, vram, ).rows} == {4096, 16384, 32768}  # type: ignore[union-attr]
    long = context_table(replace(info, n_ctx_train=262144), vram)
    assert long is not None and {r.n_ctx for r in long.rows} == set(TABLE_CTX)
    unknown = context_table(replace(info, n_ctx_train=0), vram)  # unknown: up to 128K
    assert unknown is not None and {r.n_ctx for r in unknown.rows} == set(TABLE_CTX)
    short = context_table(replace(info, n_ctx_train=2048), vram)
    assert short is not None and short.rows == ()
    dense = read_model_info(QWEN_FIXTURE)
    assert context_table(replace(dense, n_expert=0, n_expert_used=0), vram) is None  # no experts: no table


def test_the_whole_model_case(info: ModelInfo) -> None:
    vram = _budget(info, info.n_expert) + 4 * 2**30  # every expert, and room for a longer context
    table = context_table(info, vram)
    assert table is not None
    first = table.rows[0]
    assert first.whole_model_fits and first.slots_per_layer == info.n_expert
    assert plan(check_gguf(info.path), budget_request(vram), n_ctx=4096, device=None).whole_model_fits
    assert "all" in format_context_table(table)
    assert table.slot_counts[-1] == info.n_expert  # projected like any slot count
    choice = default_context(info, vram, F16)
    assert choice is not None and choice.n_ctx == 32768  # the longest the model allows keeps (nearly) every expert


def test_a_budget_the_dense_part_does_not_fit(info: ModelInfo) -> None:
    table = context_table(info, 2**20)
    assert table is not None and not any(r.dense_fits for r in table.rows) and table.slot_counts == ()
    assert "no fit" in format_context_table(table)
    assert default_context(info, 2**20, F16) is None  # nothing to choose from: the engine's default


def _budgets(info: ModelInfo) -> list[int]:
    """Budgets from 20 slots at 4096 tokens to the whole model with room for longer contexts."""
    return [_budget(info, 20), _budget(info, 100), _budget(info, 128) + 2**30, _budget(info, 128) + 3 * 2**30]


def test_the_default_context_keeps_the_cache_useful(info: ModelInfo) -> None:
    for vram in _budgets(info):
        choice = default_context(info, vram, F16)
        assert choice is not None
        table = context_table(info, vram)
        assert table is not None
        f16 = {r.n_ctx: r.slots_per_layer for r in table.rows if r.kv_type == "f16"}
        keep = [c for c, n in f16.items() if n >= KEEP_SLOTS * f16[4096] and n >= min(info.n_expert_used, f16[4096])]
        assert choice.n_ctx == max(keep)  # the largest context that keeps >= 75% of the 4K slots
        assert f"context {choice.n_ctx} chosen" in choice.note and "trained for 40960" in choice.note
        assert "`n_ctx`" in choice.note
    # a bigger budget never picks a shorter context; a quantized KV cache never a shorter one either
    picks = [default_context(info, vram, F16).n_ctx for vram in _budgets(info)]  # type: ignore[union-attr]
    assert picks == sorted(picks) and picks[0] == 4096 and picks[-1] > 4096
    q8 = KvTypes("q8_0", "q8_0")
    assert all(default_context(info, vram, q8).n_ctx >= p  # type: ignore[union-attr]
               for vram, p in zip(_budgets(info), picks, strict=True))


@pytest.mark.long  # two plans of the 30B: the long suite (`make test-long`)
def test_plan_picks_the_context_for_a_budget_and_an_explicit_one_wins(info: ModelInfo) -> None:
    header = check_gguf(info.path)
    vram = _budgets(info)[-1]
    choice = default_context(info, vram, F16)
    assert choice is not None and choice.n_ctx > 4096
    p = plan(header, budget_request(vram), n_ctx=0, device=None)
    assert p.n_ctx == p.load.n_ctx == choice.n_ctx and choice.note in p.notes
    assert p.budget is not None and p.budget.n_ctx == choice.n_ctx and p.context_table is not None
    asked = plan(header, budget_request(vram), n_ctx=4096, device=None)  # never overridden
    assert asked.n_ctx == asked.load.n_ctx == 4096 and not any("chosen" in n for n in asked.notes)
    # no budget (stock, or slots asked): the engine's default, the training context capped at 4096
    for req in (None, cache_request(expert_slots=4, policy="lru")):
        stock = plan(header, req, n_ctx=0, device=None)
        assert stock.n_ctx == 4096 and stock.load.n_ctx == 0 and stock.context_table is None


def test_the_fixtures_keep_their_default_context() -> None:
    """The fixtures were trained for 512 tokens: no row of the table, so a budget leaves the context at 512."""
    info = read_model_info(QWEN_FIXTURE)
    p = plan(check_gguf(QWEN_FIXTURE), budget_request(budget_for_slots(info, 4, 512)), n_ctx=0, device=None)
    assert p.n_ctx == 512 and p.load.n_ctx == 0 and p.slots_per_layer == 4
    assert p.context_table is not None and p.context_table.rows == ()
    assert not any("chosen" in n for n in p.notes)


def _run(*args: str) -> str:
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.long  # the 30B's context table, text and JSON: the long suite (`make test-long`)
def test_inspect_prints_the_table_and_carries_it_in_json(qwen30b: Path, info: ModelInfo) -> None:
    vram = str(_budget(info, 120))
    choice = default_context(info, int(vram), F16)
    assert choice is not None
    text = _run("inspect", str(qwen30b), "--vram", vram)
    assert "context x KV type at" in text and "q8_0*" in text and f"{choice.n_ctx}<" in text
    assert f"note: context {choice.n_ctx} chosen for --vram" in text and "pass --ctx to change" in text
    assert text.strip().splitlines()[-1].split("`")[1].endswith(f"--ctx {choice.n_ctx}")  # plan at the same one
    d = json.loads(_run("inspect", str(qwen30b), "--vram", vram, "--json"))
    rows = d["context_table"]
    assert len(rows) == 9 and {"n_ctx", "kv_type", "slots_per_layer", "decode_tps"} <= set(rows[0])
    assert d["vram_plan"]["n_ctx"] == choice.n_ctx and any("chosen" in n for n in d["notes"])
    explicit = json.loads(_run("inspect", str(qwen30b), "--vram", vram, "--ctx", "4096", "--json"))
    assert explicit["vram_plan"]["n_ctx"] == 4096 and explicit["context_table"] == rows


@pytest.mark.long  # the 30B's plan with projections: the long suite (`make test-long`)
def test_plan_prints_the_table_with_projected_speeds(qwen30b: Path, info: ModelInfo) -> None:
    vram = str(_budget(info, 100))
    d = json.loads(_run("plan", str(qwen30b), "--vram", vram, "--profile", "rtx4060-laptop", "--json"))
    rows = d["context_table"]
    assert len(rows) == 9 and all(r["decode_tps"] > 0 and r["prefill_tps"] > 0 for r in rows)
    same = {}  # one projection per slot count: rows with equal slots have equal speeds
    for r in rows:
        assert same.setdefault(r["slots_per_layer"], r["decode_tps"]) == r["decode_tps"]
    by = {(r["n_ctx"], r["kv_type"]): r for r in rows}
    assert by[(4096, "f16")]["decode_tps"] >= by[(32768, "f16")]["decode_tps"]  # fewer slots, no faster
    assert "static" in d["context_projected"] and d["n_ctx"] == default_context(info, int(vram), F16).n_ctx  # type: ignore[union-attr]
    text = _run("plan", str(qwen30b), "--vram", vram, "--profile", "rtx4060-laptop")
    assert "context x KV type at" in text and "PROJECTED decode/prefill tok/s" in text and "chosen for --vram" in text
    plain = json.loads(_run("plan", str(qwen30b), "--vram", vram, "--ctx", "4096", "--json"))  # no GPU profile
    assert plain["n_ctx"] == 4096 and all(r["decode_tps"] is None for r in plain["context_table"])
    # --expert-slots plans the budget of those slots at the engine's default context, not a picked one
    slots = json.loads(_run("plan", str(qwen30b), "--expert-slots", "64", "--json"))
    assert slots["n_ctx"] == 4096 and slots["slots_per_layer"]["equal"][0] == 64


def test_simulate_plans_the_kv_cache_types_it_is_given(qwen30b: Path) -> None:
    """The simulator's budget (plan's projected rows) holds a KV cache of SimSpec.kv's types, as plan's slot line
    does: a q8_0 cache at 32K leaves more slots than f16."""
    from edgemoe.analysis.routing_profile import routing_for_model
    from edgemoe.perf.model.profile import load_profile
    from edgemoe.perf.model.simulate import SimSpec, simulate

    model = qwen30b
    tr = routing_for_model(128, 8, 12, name="qwen3-30b-a3b", n_seq=2, prefill=16, decode=16).trace
    prof = load_profile("rtx4060-laptop")
    spec = SimSpec(vram=6 * 2**30, n_ctx=32768, policies=("lru",))
    f16 = simulate(model, tr, prof, spec).slots_per_layer
    q8 = simulate(model, tr, prof, replace(spec, kv=KvTypes("q8_0", "q8_0"))).slots_per_layer
    assert q8 > f16 > 0


@pytest.mark.long  # the full-depth 30B's plans: the long suite (`make test-long`)
def test_inspect_projects_the_prefill_of_long_prompts_with_a_profile(qwen30b: Path) -> None:
    """inspect --vram --profile: the prefill of 2K/8K/32K-token prompts, stock and edgemoe each at its fastest
    ubatch, in the text and in --json; without --profile there is none; a CPU profile is refused."""
    out = json.loads(_run("inspect", str(qwen30b), "--vram", "6GiB", "--profile", "rtx4060-laptop", "--json"))
    assert [p["prompt_tokens"] for p in out["prefill"]] == [2048, 8192, 32768]
    for p in out["prefill"]:
        kinds = [(c["kind"], c["borrow"]) for c in p["choices"]]  # the borrowing side where its buffers fit
        assert kinds[:2] == [("stock", False), ("edgemoe", False)] and kinds[2:] in ([], [("edgemoe", True)]), kinds
        assert all(c["best"]["n_ubatch"] >= 512 and c["reason"] for c in p["choices"])
    text = _run("inspect", str(qwen30b), "--vram", "6GiB", "--profile", "rtx4060-laptop")
    assert "prefill of a 8192-token prompt" in text and "time to first token" in text
    assert "prefill" not in json.loads(_run("inspect", str(qwen30b), "--vram", "6GiB", "--json"))
    res = CliRunner().invoke(cli, ["inspect", str(qwen30b), "--vram", "6GiB", "--profile",
                                   str(Path(__file__).resolve().parent.parent / "docs" / "figures" /
                                       "cpu-projection-check-lead-profile.json")])
    assert res.exit_code == 2 and "needs a GPU profile" in res.output
