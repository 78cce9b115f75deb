"""The prefill ubatch in the runtime: -b/-ub validated, a given -ub reaching the engine, and with a budget,
--device-prefill and a GPU profile the plan's pick (edgemoe.plan.ubatch) with its slots; bench's rows' ubatches."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemoe.cli import cli
from edgemoe.errors import InvalidConfigError
from edgemoe.gguf.header import check_gguf
from edgemoe.perf.bench.rows import BenchSpec, bench_ubatches
from edgemoe.perf.model.prefill_plan import ProfilePricing
from edgemoe.perf.model.profile import load_profile
from edgemoe.placement import Device, cache_request, open_engine, plan
from edgemoe.runtime.config import LoadConfig, check_batches

from helpers.models import FIXTURE_MODELS

MODEL = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
LAPTOP = "rtx4060-laptop"


@pytest.mark.parametrize("batch, ubatch, ctx, match", [
    (None, 0, 256, "at least 1"),
    (0, None, 256, "at least 1"),
    (512, 1024, 4096, "larger than `n_batch=512`"),
    (None, 1024, 512, "the context holds 512"),
    (4096, None, 1024, "the context holds 1024"),
])
def test_a_bad_batch_or_ubatch_is_one_typed_line(batch: int | None, ubatch: int | None, ctx: int, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match) as err:
        check_batches(batch, ubatch, ctx)
    assert "\n" not in str(err.value)
    check_batches(ubatch, ubatch, max(ctx, 4096)) if ubatch else None  # the same ubatch with a batch that holds it


def test_a_load_config_s_ubatch_above_its_batch_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match="`n_ubatch=1024` is larger"):
        LoadConfig(n_batch=512, n_ubatch=1024).validate(n_expert=8, n_expert_used=2)
    LoadConfig(n_ctx=256).validate(n_expert=8, n_expert_used=2)  # the default 512 under a small context: clamped


def test_the_plan_keeps_512_or_takes_a_given_ubatch_with_a_batch_that_holds_it() -> None:
    header = check_gguf(MODEL)
    p = plan(header, None, n_ctx=2048, device=None)
    assert (p.load.n_batch, p.load.n_ubatch, p.prefill_ubatch) == (512, 512, 512)
    p = plan(header, None, n_ctx=2048, device=None, n_ubatch=1024)
    assert (p.load.n_batch, p.load.n_ubatch, p.prefill_ubatch) == (1024, 1024, 1024)
    assert "given" in p.prefill_ubatch_reason
    with pytest.raises(InvalidConfigError, match="context holds 2048"):
        plan(header, None, n_ctx=2048, device=None, n_ubatch=4096)


def test_the_engine_opens_with_the_given_ubatch() -> None:
    with open_engine(MODEL, n_ctx=1024, n_ubatch=1024) as eng:
        assert (eng.n_batch, eng.n_ubatch) == (1024, 1024)
    with open_engine(MODEL, n_ctx=1024) as eng:
        assert (eng.n_batch, eng.n_ubatch) == (512, 512)


def _synthetic_30b(tmp_path: Path) -> Path:
    from edgemoe.gguf.synth import write_synthetic

    return write_synthetic("qwen3-30b-a3b", tmp_path / "q30.gguf", shape_only=True, progress=False)


@pytest.mark.long  # prefill replays per ubatch: the long suite (`make test-long`)
def test_the_plan_picks_a_larger_ubatch_for_device_prefill_out_of_the_slots(tmp_path: Path) -> None:
    header = check_gguf(_synthetic_30b(tmp_path))
    req = cache_request(vram=8 << 30, policy="manual", device_prefill=256)
    laptop = ProfilePricing(load_profile(LAPTOP))
    base = plan(header, req, n_ctx=8192, device=Device("CUDA0"))
    picked = plan(header, req, n_ctx=8192, device=Device("CUDA0"), profile=laptop)
    assert base.prefill_ubatch == 512 and picked.prefill_ubatch > 512
    assert picked.load.n_ubatch == picked.prefill_ubatch <= picked.load.n_batch
    assert picked.slots_per_layer is not None and base.slots_per_layer is not None
    assert picked.slots_per_layer < base.slots_per_layer  # the larger compute buffer came out of the slots
    assert f"-ub {picked.prefill_ubatch} is the smallest within 5%" in picked.prefill_ubatch_reason
    assert any(n.startswith(f"note: prefill ubatch {picked.prefill_ubatch}") for n in picked.notes)
    # the context steps (tiers) keep the larger compute buffer out of every step's slots too, and none holds fewer
    # tokens than the batch
    assert [s.n_ctx for s in base.context_steps] == [s.n_ctx for s in picked.context_steps] == [4096, 8192]
    assert picked.context_steps[-1].slots_per_layer == picked.slots_per_layer
    assert all(a.slots_per_layer > b.slots_per_layer
               for a, b in zip(base.context_steps, picked.context_steps, strict=True))
    assert all(s.n_ctx >= picked.load.n_batch for s in picked.context_steps)
    assert sum("the context grows in steps" in n for n in picked.notes) == 1
    # borrowing: the borrowing side's pick, with the slots of a budget without the buffers
    lend = cache_request(vram=8 << 30, policy="manual", device_prefill=256, device_prefill_borrow=True)
    lent = plan(header, lend, n_ctx=8192, device=Device("CUDA0"), profile=laptop)
    assert "device-prefill-borrow on" in lent.prefill_ubatch_reason
    assert lent.slots_per_layer is not None and lent.slots_per_layer > picked.slots_per_layer
    # a -ub given wins; no device prefill, no pick
    given = plan(header, req, n_ctx=8192, device=Device("CUDA0"), n_ubatch=1024)
    assert plan(header, req, n_ctx=8192, device=Device("CUDA0"), profile=laptop, n_ubatch=1024) == given
    assert given.prefill_ubatch == 1024 and given.prefill_ubatch_reason == "given (`n_ubatch`)"
    plain = cache_request(vram=8 << 30, policy="manual")
    p = plan(header, plain, n_ctx=8192, device=Device("CUDA0"))
    assert plan(header, plain, n_ctx=8192, device=Device("CUDA0"), profile=laptop) == p


def test_open_engine_runs_the_plan_s_ubatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget, device prefill and a named profile, the engine opens at the ubatch plan() picked with the
    profile's prefill model (the fixture's shape is not priced well by the laptop's profile: its pick stubbed)."""
    from edgemoe.gguf.info import read_model_info
    from edgemoe.placement import open as open_mod
    from edgemoe.plan.budget import prefill_buffer_bytes
    from edgemoe.plan.reserve import budget_for_slots, ubatch_reserve_bytes
    from edgemoe.plan.ubatch import UbatchPick

    seen = []
    real = open_mod.prefill_pricing

    class Picked:
        def __init__(self, name: str) -> None:
            self.name = name

        def pick_ubatch(self, header: object, question: object) -> UbatchPick:
            return UbatchPick(640, "stubbed")  # a larger one's buffer would leave the fixture no slot

    def pricing(name: str | None) -> Picked | None:
        found = real(name)
        if found is None:
            return None
        seen.append(found.name)
        return Picked(found.name)

    monkeypatch.setattr(open_mod, "prefill_pricing", pricing)
    info = read_model_info(MODEL)
    vram = budget_for_slots(info, 8, 2048) + prefill_buffer_bytes(info)
    cache = cache_request(vram=vram, policy="lru", device_prefill=16, profile=LAPTOP)
    notes: list[str] = []
    with open_engine(MODEL, cache=cache, n_ctx=2048, notify=notes.append) as eng:
        assert (eng.n_batch, eng.n_ubatch) == (640, 640) and eng.experts is not None
    extra = ubatch_reserve_bytes(info, 2048, 640, flash_attn=True)
    assert f"note: prefill ubatch 640 (`n_ubatch`; the compute buffer takes {extra / 2**20:.0f} MiB" in "".join(notes)
    assert seen and "4060" in seen[0]
    with open_engine(MODEL, cache=replace(cache, profile=None), n_ctx=2048) as eng:  # no GPU, no profile: 512
        assert eng.n_ubatch == 512
    assert len(seen) == 1


@pytest.mark.parametrize("args, match", [
    (["--ubatch", "0"], "--ubatch 0: give at least 1"),
    (["--batch", "256", "--ubatch", "512"], "--ubatch 512 is larger than --batch 256"),
])
def test_generate_refuses_a_bad_ubatch(args: list[str], match: str) -> None:
    res = CliRunner().invoke(cli, ["generate", str(MODEL), "-p", "hi", "-n", "2", "--ctx", "512", *args])
    assert res.exit_code != 0 and match in res.output, res.output


def test_every_running_command_has_the_batch_options() -> None:
    for cmd in ("chat", "generate", "serve", "bench"):
        out = CliRunner().invoke(cli, [cmd, "--help"]).output
        assert "--ubatch" in out, cmd
        assert cmd == "bench" or "--batch" in out, cmd


@pytest.mark.long  # every bench row's plan: the long suite (`make test-long`)
def test_bench_s_rows_take_the_plan_s_ubatches(tmp_path: Path) -> None:
    header = check_gguf(_synthetic_30b(tmp_path))
    spec = BenchSpec(vram=8 << 30, prompt_tokens=8192, n_ctx=8192, flash_attn="auto")
    cpu = bench_ubatches(header, spec, 8192, None)  # no GPU, or no GPU profile: llama.cpp's 512
    assert (cpu.stock, cpu.cache, cpu.note) == (512, 512, "")
    given = bench_ubatches(header, replace(spec, n_ubatch=1024), 8192, None)
    assert (given.stock, given.cache) == (1024, 1024) and "given" in given.note
    gpu = bench_ubatches(header, spec, 8192, ProfilePricing(load_profile(LAPTOP), prompt_tokens=8192))
    assert gpu.stock > 512 and gpu.cache == 512
    assert f"stock {gpu.stock} (--n-cpu-moe " in gpu.note and "--n-cpu-moe None" not in gpu.note
    # the +device prefill rows' ubatch is plan()'s pick with the same prefill model
    req = cache_request(vram=8 << 30, policy="lru", device_prefill=256)
    picked = plan(header, req, n_ctx=8192, device=Device("CUDA0"),
                  profile=ProfilePricing(load_profile(LAPTOP), prompt_tokens=8192))
    assert picked.prefill_ubatch > 512 and f"+device prefill {picked.prefill_ubatch}" in gpu.note


def test_bench_projects_each_gpu_row_at_the_ubatch_it_ran() -> None:
    """On a GPU, stock runs at its best -ub with the --n-cpu-moe beside that buffer and +device prefill at its own
    -ub with fewer slots: their projections are the simulator's at those, not at the cached rows' 512."""
    from edgemoe.gguf.info import read_model_info
    from edgemoe.perf.bench.project import projections
    from edgemoe.perf.bench.records import BenchRow, Projection, RowResult
    from edgemoe.perf.model.simulate import SimSpec, simulate

    from helpers.models import QWEN
    from helpers.traces import skewed_trace

    tr, prof = skewed_trace(QWEN, n_seq=2, prefill=96, decode=8), load_profile("rtx4060-laptop")
    base = SimSpec(vram=600 * 2**20, n_ctx=512, n_ubatch=32, policies=("lru",), warmup_seqs=1, overlap=True)
    moe = len(read_model_info(QWEN).moe_layers)
    slots = {il: 5 for il in read_model_info(QWEN).moe_layers}
    placement = plan(check_gguf(QWEN), None, n_ctx=512, device=None)
    projected = [
        Projection("stock-ot-exps-cpu", 32),  # at the cached rows' ubatch: the main run's
        Projection(f"stock-n-cpu-moe-{moe - 2}", 64, n_cpu_moe=moe - 2, policies=()),
        Projection("edgemoe-lru", 32),
        Projection("edgemoe-lru-device-prefill", 64, policies=("lru",), device_prefill_slots=slots),
    ]
    names = ["stock -ot exps=CPU", f"stock --n-cpu-moe {moe - 2}", "edgemoe lru", "edgemoe lru +device prefill"]
    rows = [BenchRow(n, n.split()[0], placement, projection=p) for n, p in zip(names, projected, strict=True)]
    results = [RowResult(r.name, r.kind, 1.0, 1.0, 1.0, 1.0, None, n_ubatch=r.projection.n_ubatch)  # type: ignore[union-attr]
               for r in rows]
    out, _ = projections(rows, results, QWEN, tr, prof, base)
    assert set(out) == set(names)
    main = {c.name: c for c in simulate(QWEN, tr, prof, base).configs}
    assert out["stock -ot exps=CPU"] == main["stock-ot-exps-cpu"] and out["edgemoe lru"] == main["edgemoe-lru"]
    stock = simulate(QWEN, tr, prof, replace(base, n_ubatch=64, n_cpu_moe=moe - 2, policies=()))
    want = next(c for c in stock.configs if c.name == f"stock-n-cpu-moe-{moe - 2}")
    assert out[f"stock --n-cpu-moe {moe - 2}"] == want
    at_32 = simulate(QWEN, tr, prof, replace(base, n_cpu_moe=moe - 2, policies=()))
    assert next(c for c in at_32.configs if c.name == want.name).prefill_tps != want.prefill_tps
    pf = replace(base, n_ubatch=64, device_prefill=True, device_prefill_slots=slots)
    want = next(c for c in simulate(QWEN, tr, prof, pf).configs if c.name == "edgemoe-lru-device-prefill")
    assert out["edgemoe lru +device prefill"] == want
    beside = next(c for c in simulate(QWEN, tr, prof, replace(pf, device_prefill_slots=None)).configs
                  if c.name == want.name)
    assert beside.hit_rate != want.hit_rate  # the row's own 5 slots, not what the budget leaves
