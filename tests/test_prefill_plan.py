"""The prefill ubatch the plan picks for a long prompt: llama.cpp's compute buffer against the ubatch, the slots it takes,
stock compared at its own best -ub, and `edgemoe plan --prompt-tokens`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.routing_profile import routing_for_model
from edgemoe.analysis.trace import DECODE, PREFILL
from edgemoe.cli import cli
from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.model.costmodel import ModelShape
from edgemoe.perf.model.prefill_plan import UBATCHES, PrefillPlanner, PrefillSpec, project_prompts, settled
from edgemoe.perf.model.profile import load_profile
from edgemoe.perf.model.workload import prompt_workload
from edgemoe.plan.budget import BORROW_SLACK, best_n_cpu_moe, borrow_fits, lent_layers, prefill_buffer_bytes
from edgemoe.plan.reserve import (
    PLAN_UBATCH,
    Reserve,
    compute_buffer_bytes,
    reserve_bytes,
    ubatch_reserve_bytes,
)

from helpers.models import FIXTURE_MODELS

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
MIB = 2**20


def test_the_compute_buffer_grows_with_the_ubatch_and_less_with_flash_attention() -> None:
    info = read_model_info(QWEN)
    # llama.cpp's CPU compute buffers of this fixture (`compute buffer size` in its log), the estimate's fit
    measured = {(False, 4096, 512): 43.01, (False, 16384, 2048): 652.04, (True, 4096, 2048): 32.05,
                (True, 16384, 512): 20.01}
    for (fa, ctx, ub), mib in measured.items():
        est = compute_buffer_bytes(info, ctx, ub, flash_attn=fa) / MIB
        assert 0.99 * mib <= est <= 1.15 * mib, (fa, ctx, ub, est)
    for fa in (False, True):
        sizes = [compute_buffer_bytes(info, 16384, u, flash_attn=fa) for u in UBATCHES]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    growth = {fa: compute_buffer_bytes(info, 16384, 4096, flash_attn=fa) - compute_buffer_bytes(
        info, 16384, 512, flash_attn=fa) for fa in (False, True)}
    assert 0 < growth[True] < growth[False] / 4
    # the plan's reserve is sized for its ubatch: nothing more there, more past it
    assert ubatch_reserve_bytes(info, 4096, PLAN_UBATCH, flash_attn=True) == 0
    assert ubatch_reserve_bytes(info, 4096, 4096, flash_attn=True) > 0


def test_the_30b_shape_s_buffer_is_its_logits_with_flash_attention(tmp_path: Path) -> None:
    model = _synthetic_30b(tmp_path)
    info = read_model_info(model)
    # measured on the CPU backend (placement.budget.context_reserve_bytes): 305 MiB at 4096 with 512-token ubatches,
    # 2142 MiB at 32768 without flash attention
    assert abs(compute_buffer_bytes(info, 4096, 512, flash_attn=True) / MIB - 305) < 305 * 0.02
    assert abs(compute_buffer_bytes(info, 32768, 512, flash_attn=False) / MIB - 2142) < 2142 * 0.02
    logits = 2048 * info.n_vocab * 4
    assert logits < compute_buffer_bytes(info, 8192, 2048, flash_attn=True) < 1.1 * logits


def test_a_prompt_s_routing_repeats_the_trace_s_prefill_tokens() -> None:
    shape = ModelShape.read(QWEN)
    trace = routing_for_model(shape.n_expert, shape.n_expert_used, len(shape.moe_layers)).trace
    work = prompt_workload(trace, shape.moe_layers, shape.n_expert, shape.n_expert_used, n_tokens=3000,
                           n_ubatch=1024)
    assert [s.n_tokens for s in work.steps] == [1024, 1024, 952]
    assert [s.kv_len for s in work.steps] == [0, 1024, 2048] and {s.phase for s in work.steps} == {PREFILL}
    pre = np.flatnonzero(trace.phase == PREFILL)
    first = trace.ids[pre[0], : len(shape.moe_layers)]
    assert np.array_equal(work.steps[0].ids[0], first)
    assert int((trace.phase == DECODE).sum()) > 0 and "prefill tokens in order" in work.note


def _synthetic_30b(tmp_path: Path, layers: int | None = None) -> Path:
    from edgemoe.gguf.synth import write_synthetic

    return write_synthetic("qwen3-30b-a3b", tmp_path / "q30.gguf", layers=layers, shape_only=True, progress=False)


def test_the_plan_picks_a_larger_ubatch_out_of_the_slots_and_stock_at_its_own_best(tmp_path: Path) -> None:
    shape = ModelShape.from_header(check_gguf(_synthetic_30b(tmp_path)))
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    prof = load_profile("rtx4060-laptop")
    spec = PrefillSpec(vram=8 * 2**30, n_ctx=4096)
    p = PrefillPlanner(shape, trace, prof, spec).project(8192)
    assert p.n_ctx == 8192  # the prompt's KV cache is placed with it
    stock, ours, lent = p.choices
    assert (stock.kind, ours.kind) == ("stock", "edgemoe") and ours.config == "edgemoe-static-device-prefill"
    assert (lent.kind, lent.config, lent.borrow, ours.borrow) == ("edgemoe", ours.config + "-borrow", True, False)
    for c in (stock, ours, lent):
        assert [o.n_ubatch for o in c.options] == list(UBATCHES)
        assert c.best.prefill_tps == max(o.prefill_tps for o in c.options)
        assert c.best.n_ubatch >= 512 and f"-ub {c.best.n_ubatch}" in c.reason
        assert c.best.ttft_s == pytest.approx(8192 / c.best.prefill_tps)
    slots = [o.slots_per_layer for o in ours.options]
    assert all(s is not None for s in slots) and slots == sorted(slots, reverse=True) and slots[0] > slots[-1]
    # stock's -ub takes its buffer out of stock's GPU layers, by the same arithmetic
    for o in stock.options:
        extra = ubatch_reserve_bytes(info, 8192, o.n_ubatch, flash_attn=True)
        assert o.extra_reserve_bytes == extra
        stock_reserve = reserve_bytes(info, 8192, Reserve(n_ubatch=o.n_ubatch))
        assert o.n_cpu_moe == best_n_cpu_moe(info, 8 * 2**30, 8192, reserve_bytes=stock_reserve)
    assert stock.options[-1].n_cpu_moe > stock.options[0].n_cpu_moe
    # the ubatch is the lever: a larger one beats 512 on both sides, and edgemoe beats stock's best
    assert ours.best.n_ubatch > 512 and stock.best.n_ubatch > 512
    assert ours.best.prefill_tps > ours.options[0].prefill_tps and ours.options[0].bound == "copy"
    assert ours.best.prefill_tps >= stock.best.prefill_tps
    # borrowing: decode keeps the slots of a budget without the buffers, the last layers lent to them while the
    # prompt runs (no slot there: every routed expert copied), at about the same prefill on this card
    for o, b in zip(ours.options, lent.options, strict=True):
        assert b.slots_per_layer is not None and o.slots_per_layer is not None
        assert b.slots_per_layer > o.slots_per_layer and b.lent_layers == lent_layers(info, b.slots_per_layer) > 0
        assert o.lent_layers == 0 and abs(b.prefill_tps / o.prefill_tps - 1) < 0.05
    assert lent.best.prefill_tps >= 0.95 * ours.best.prefill_tps
    # the ceiling: every expert resident, nothing copied, whatever the budget; no option passes it, and this
    # GPU-bound prompt at 8 GiB comes within 1% of it (what the copies left of the prompt's time)
    assert p.ceiling_ubatch in UBATCHES and all(o.prefill_tps <= p.ceiling_tps for c in p.choices for o in c.options)
    assert ours.best.bound == "gpu" and ours.best.prefill_tps > 0.99 * p.ceiling_tps
    assert stock.options[0].prefill_tps < 0.5 * p.ceiling_tps  # stock at 512: copy-bound, far below it
    # decode's first tokens after it, each edgemoe side at the ubatch an engine opens with
    d, o, b = p.decode_after, settled(ours), settled(lent)
    assert d is not None and d.decode_tokens == 64 and d.beside_tps > 0 and d.borrow_tps > 0
    assert (d.beside.n_ubatch, d.beside.slots_per_layer) == (o.n_ubatch, o.slots_per_layer)
    assert (d.borrow.slots_per_layer, d.borrow.lent_layers) == (b.slots_per_layer, b.lent_layers) and d.refill_s > 0
    # prompts past the model's training context are skipped, said
    some, notes = project_prompts(shape, trace, prof, spec, (2048, 10**6))
    assert [x.prompt_tokens for x in some] == [2048] and "training context" in notes[0] and "fastest" in notes[1]
    assert all(o.n_ubatch <= 2048 for c in some[0].choices for o in c.options)


@pytest.mark.long  # prefill replays per prompt length: the long suite (`make test-long`)
def test_plan_prompt_tokens_cli(tmp_path: Path) -> None:
    model = _synthetic_30b(tmp_path, layers=6)  # the plan's decode rows replay every policy: a short model
    args = ["plan", str(model), "--vram", "2GiB", "--profile", "rtx4060-laptop", "--prompt-tokens", "2048"]
    r = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    (p,) = d["prefill"]
    assert p["prompt_tokens"] == 2048 and [c["kind"] for c in p["choices"]] == ["stock", "edgemoe", "edgemoe"]
    assert [c["borrow"] for c in p["choices"]] == [False, False, True]
    assert all(c["best"]["n_ubatch"] in UBATCHES and c["best"]["prefill_tps"] > 0 for c in p["choices"])
    text = CliRunner().invoke(cli, args, catch_exceptions=False).output
    assert "prefill of a 2048-token prompt" in text and "time to first token" in text
    assert f"every expert resident, at -ub {p['ceiling_ubatch']}: {p['ceiling_tps']:.0f} tok/s" in text
    d = p["decode_after"]
    assert f"decode of the first 64 tokens after it: {d['beside_tps']:.1f} tok/s" in text
    long = next(line for line in text.splitlines() if "PROJECTED for long prompts" in line)
    assert f"--ctx {p['n_ctx']} " in long and "--device-prefill 32" in long and "-ub " in long
    assert "8192-token prompt" not in text  # --prompt-tokens: that prompt alone


def test_the_lent_layers_are_the_fewest_from_the_last_back_that_hold_both_buffers() -> None:
    info = read_model_info(QWEN)
    per = {il: info.bytes_per_expert_by_layer[il] for il in info.moe_layers}
    need = prefill_buffer_bytes(info)
    for slots in range(1, info.n_expert + 1):
        n = lent_layers(info, slots)
        assert (n > 0) == borrow_fits(info, slots)
        if n:
            held = [slots * per[il] - BORROW_SLACK for il in reversed(info.moe_layers)]
            assert sum(held[:n]) >= need > sum(held[: n - 1])


def test_decode_after_a_borrowed_prompt_refills_the_lent_layers_over_the_copy_stream() -> None:
    """The lent layers come back empty: with a link too slow for any refill to land in 64 tokens their experts all
    run on the CPU (as with no slot there); with an instant one decode runs as if the refill were resident; lending
    nothing is the other side exactly."""
    from dataclasses import replace

    from edgemoe.perf.model.prefill_decode import SideSlots, decode_after_prompt
    from edgemoe.perf.model.prompt_replay import replay_prompt
    from edgemoe.perf.model.sim.config import Config
    from edgemoe.perf.model.simulate import estimate_graph_nodes, static_frequency

    shape = ModelShape.read(QWEN)
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    prof = load_profile("rtx4060-laptop")
    moe = shape.moe_layers
    whole = static_frequency(prompt_workload(trace, moe, info.n_expert, info.n_expert_used, n_tokens=256,
                                             n_ubatch=256))
    kw = dict(policy="static", frequency=whole, nodes=estimate_graph_nodes(shape), prompt_tokens=512)
    side, lent = SideSlots(256, 12), SideSlots(256, 12, lent_layers=3)
    same = decode_after_prompt(shape, trace, prof, beside=side, borrow=side, **kw)  # type: ignore[arg-type]
    assert same is not None and same.borrow_tps == same.beside_tps and same.refill_bytes == 0
    d = decode_after_prompt(shape, trace, prof, beside=side, borrow=lent, **kw)  # type: ignore[arg-type]
    assert d is not None and d.refill_bytes == 12 * sum(shape.expert_bytes(il) for il in moe[-3:])
    assert d.refill_s == pytest.approx(d.refill_bytes / prof.link.loads_bw)
    slow = replace(prof, link=replace(prof.link, h2d_loads=1.0))
    fast = replace(prof, link=replace(prof.link, h2d_loads=1e18))
    never = decode_after_prompt(shape, trace, slow, beside=side, borrow=lent, **kw)  # type: ignore[arg-type]
    at_once = decode_after_prompt(shape, trace, fast, beside=side, borrow=lent, **kw)  # type: ignore[arg-type]
    assert never is not None and at_once is not None
    assert never.borrow_tps < d.borrow_tps <= at_once.borrow_tps  # 0.1 ms of refill: landed by the lent layers
    from edgemoe.perf.model.prefill_decode import decode_steps

    work = decode_steps(trace, shape, kv_start=512, n=64)
    empty = Config("e", "edgemoe", policy="static", slots={il: 0 if il in moe[-3:] else 12 for il in moe})
    want = replay_prompt(shape, prof, empty, work, nodes=estimate_graph_nodes(shape), frequency=whole)[0]
    assert never.borrow_tps == pytest.approx(want, rel=1e-9)
    assert decode_after_prompt(shape, trace, prof, beside=side, borrow=lent,  # type: ignore[arg-type]
                               **{**kw, "policy": "lru"}) is None  # the refill is a placement by counts


def test_the_long_prompt_command_follows_the_projection() -> None:
    """plan's long-prompt command: device prefill at the ubatch an engine opens with, borrowing where it keeps
    prefill within 3% and decode's first tokens no slower; nothing where stock prefills as fast."""
    from dataclasses import replace

    from edgemoe.perf.model.layouts import long_prompt
    from edgemoe.perf.model.prefill_decode import DecodeAfterPrompt, SideSlots
    from edgemoe.perf.model.prefill_plan import (
        PrefillChoice,
        PrefillProjection,
        UbatchOption,
        long_prompt_run,
    )

    def opt(u: int, tps: float) -> UbatchOption:
        return UbatchOption(u, 0, 0, 8, None, tps, 8192 / tps, "gpu")

    def choice(kind: str, borrow: bool, *tps: float) -> PrefillChoice:
        opts = tuple(opt(u, t) for u, t in zip((1024, 2048), tps, strict=False))
        return PrefillChoice(kind, kind, max(opts, key=lambda o: o.prefill_tps), opts, "", borrow)

    after = DecodeAfterPrompt(64, SideSlots(2048, 36), 50.0, SideSlots(2048, 41, 7), 51.0, 1, 0.1)
    p = PrefillProjection(8192, 8192, True, (choice("stock", False, 800.0), choice("edgemoe", False, 1350, 1400),
                                            choice("edgemoe", True, 1340, 1390)), decode_after=after)
    run = long_prompt_run([p])
    assert run is not None and (run.n_ctx, run.n_ubatch, run.borrow, run.more_slots) == (8192, 1024, True, 5)
    sg = {"config": "edgemoe-daop", "allocation": "equal"}
    lp = long_prompt(sg, run, model="m.gguf", vram=8 << 30)
    assert lp["command"] == ("edgemoe chat m.gguf --vram 8GiB --ctx 8192 --policy daop --alloc equal -ub 1024 "
                             "--device-prefill 32 --device-prefill-borrow")
    assert "1340 tok/s on the 8192-token prompt against stock's best 800" in lp["why"] and "5 more slots" in lp["why"]
    slower = long_prompt_run([replace(p, decode_after=replace(after, borrow_tps=49.0))])  # decode slower: no borrow
    assert slower is not None and not slower.borrow
    assert long_prompt(sg, slower, model="m.gguf", vram=8 << 30)["command"].endswith("-ub 1024 --device-prefill 32")
    stock_wins = replace(p, choices=(choice("stock", False, 1500.0), *p.choices[1:]))
    assert long_prompt_run([stock_wins]) is None and long_prompt_run([]) is None
