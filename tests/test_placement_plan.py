"""edgemoe.placement.plan: one PlacementPlan per open, decided before anything loads (no native library), and
open_engine loading from it: the budget split once, first-use calibration on the one Engine it opens."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.info import read_model_info
from edgemoe.placement import Device, PlacementError, budget_request, cache_request, open_engine, plan
from edgemoe.plan.budget import engine_ctx, estimate_kv_cache_bytes, prefill_buffer_bytes
from edgemoe.plan.reserve import VRAM_RESERVE, budget_for_slots, context_reserve_bytes
from edgemoe.runtime.cache_config import ExpertCacheError
from edgemoe.runtime.config import LoadConfig

from helpers.models import FIXTURE_MODELS

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
GPU = Device(name="CUDA0", free_bytes=8 * 2**30)


def _whole(path: Path, n_ctx: int) -> int:
    """The smallest --vram that holds every weight of `path` at a context of n_ctx (a multiple of 256)."""
    info = read_model_info(path)
    return (info.dense_bytes + estimate_kv_cache_bytes(info, n_ctx) + VRAM_RESERVE + context_reserve_bytes(info, n_ctx)
            + info.n_expert * sum(info.bytes_per_expert_by_layer.values()))


def test_the_context_is_the_engines() -> None:
    """0: the model's training context (the fixtures': 512), at most 4096; llama.cpp pads to steps of 256."""
    header = check_gguf(QWEN)
    assert plan(header, None, n_ctx=0, device=None).n_ctx == 512 == engine_ctx(0, 512)
    assert engine_ctx(0, 0) == engine_ctx(0, 32768) == 4096 and engine_ctx(1, 512) == 256
    rounded = plan(header, None, n_ctx=300, device=None)
    assert rounded.n_ctx == 512 and rounded.load.n_ctx == 300  # the engine is given what was asked
    assert rounded.notes == ("note: the context is 512 tokens (llama.cpp sizes it in steps of 256; a context of "
                             "300 was asked)",)
    assert plan(header, None, n_ctx=256, device=None).notes == ()


def test_stock_without_a_request_or_a_gpu() -> None:
    header = check_gguf(QWEN)
    p = plan(header, None, n_ctx=256, device=GPU, n_threads=3, n_gpu_layers=7)
    assert p.load == LoadConfig(n_ctx=256, n_threads=3, n_gpu_layers=7)
    assert not p.cache and p.slots_per_layer is None and p.budget is None and p.n_cpu_moe is None
    req = cache_request(expert_slots=2, policy="lru")
    cpu = plan(header, req, n_ctx=256, device=None)  # no GPU: the cache runs on a CPU stand-in
    assert cpu.load == LoadConfig(n_ctx=256) and cpu.cache and cpu.slots_per_layer == 2
    assert cpu.budget is None and cpu.calibration.stages == ()


def test_a_budget_leaves_slots_with_the_experts_in_cpu_memory() -> None:
    header = check_gguf(QWEN)
    info = read_model_info(QWEN)
    vram = budget_for_slots(info, 2, 256)
    p = plan(header, cache_request(vram=vram, policy="lru"), n_ctx=256, device=GPU)
    assert p.cache and not p.whole_model_fits and p.slots_per_layer == 2
    assert p.load == LoadConfig(n_ctx=256, n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers))
    assert p.budget is not None and p.budget.experts_per_layer == 2 and p.budget.n_ctx == 256
    assert p.slot_bytes == p.budget.slot_bytes == sum(info.bytes_per_expert_by_layer.values())
    assert p.kv_cache_bytes == estimate_kv_cache_bytes(info, 256) and p.reserve_bytes == VRAM_RESERVE
    assert p.expert_budget_bytes == p.budget.expert_budget_bytes >= 2 * p.slot_bytes
    assert p.notes == ()
    # --device-prefill's two buffers come out of the same budget: fewer slots
    pf = plan(header, cache_request(vram=vram, policy="lru", device_prefill=32), n_ctx=256, device=GPU)
    assert pf.reserve_bytes == VRAM_RESERVE + prefill_buffer_bytes(info)
    assert pf.slots_per_layer is not None and pf.slots_per_layer < 2


def test_a_budget_that_holds_every_weight_loads_the_model_as_stock() -> None:
    header = check_gguf(QWEN)
    whole = _whole(QWEN, 256)
    p = plan(header, cache_request(vram=whole, policy="lru"), n_ctx=256, device=GPU)
    assert p.whole_model_fits and not p.cache and p.slots_per_layer is None
    assert p.load == LoadConfig(n_ctx=256, n_gpu_layers=999)  # every layer on the GPU, the experts too
    assert len(p.notes) == 1 and "holds the whole model" in p.notes[0] and "runs on the GPU" in p.notes[0]
    cpu = plan(header, cache_request(vram=whole, policy="lru"), n_ctx=256, device=None)
    assert cpu.load == LoadConfig(n_ctx=256) and "no GPU in this build" in cpu.notes[0]
    one_short = plan(header, cache_request(vram=whole - 1, policy="lru"), n_ctx=256, device=GPU)
    assert not one_short.whole_model_fits and one_short.cache
    # the whole model on the GPU needs no --device-prefill buffers: they do not count against it
    pf = plan(header, cache_request(vram=whole, policy="lru", device_prefill=32), n_ctx=256, device=GPU)
    assert pf.whole_model_fits


def test_refusals_come_before_anything_loads() -> None:
    header = check_gguf(QWEN)
    n_expert = read_model_info(QWEN).n_expert
    with pytest.raises(ExpertCacheError, match=f"`expert_slots={n_expert + 1}`: use 0..{n_expert}"):
        plan(header, cache_request(expert_slots=n_expert + 1, policy="lru"), n_ctx=256, device=None)
    with pytest.raises(PlacementError, match="`precalc_from=99`: no MoE layer"):
        plan(header, cache_request(expert_slots=2, policy="daop", precalc_from=99), n_ctx=256, device=None)


def test_the_calibration_stages_the_policy_reads_and_the_model_lacks(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "cache"))
    req = cache_request(expert_slots=2, policy="static")
    bundled = plan(check_gguf(QWEN), req, n_ctx=256, device=None).calibration
    assert bundled.what == "`policy='static'`" and bundled.stages == ("router_frequency", "routing")
    assert bundled.missing == () and bundled.directory is not None  # the fixture's own calibration
    copy = tmp_path / "uncalibrated-qwen3moe.gguf"
    shutil.copy(QWEN, copy)
    none = plan(check_gguf(copy), req, n_ctx=256, device=None).calibration
    assert none.missing == none.stages and none.directory is None
    lru = plan(check_gguf(copy), cache_request(expert_slots=2, policy="lru"), n_ctx=256, device=None)
    assert lru.calibration.stages == lru.calibration.missing == ()


def test_synthetic_headers(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    dense = plan(check_gguf(make_tiny_gguf("tiny-llama-dense")), budget_request(2**30), n_ctx=256, device=GPU)
    assert not dense.is_moe and not dense.cache and not dense.whole_model_fits and dense.budget is not None
    assert dense.load.cpu_expert_layers == () and "is a dense model" in dense.notes[0]
    path = make_tiny_gguf("tiny-deepseek2")
    ds = plan(check_gguf(path), budget_request(2**30), n_ctx=1000, device=None)
    info = read_model_info(path)
    assert ds.n_ctx == 1024 and ds.kv_cache_bytes == estimate_kv_cache_bytes(info, 1024)  # MLA's latent cache
    assert ds.budget is not None and ds.budget.kv_cache_bytes == ds.kv_cache_bytes


def test_open_engine_splits_the_budget_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemoe.plan import budget as budget_module
    from edgemoe.plan import planner as plan_module

    vram = budget_for_slots(read_model_info(QWEN), 2, 256)
    calls: list[int] = []
    split = budget_module.slot_budget

    def counted(*args: object, **kw: object) -> object:
        calls.append(1)
        return split(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "slot_budget", counted)
    monkeypatch.setattr(budget_module, "slot_budget", counted)
    with open_engine(QWEN, vram=vram, policy="lru", n_ctx=256) as eng:
        assert eng.experts is not None and eng.experts.n_slots
    assert len(calls) == 1


def test_first_use_calibration_opens_one_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--policy static on a model without calibration: calibrated on the engine open_engine opens, then cached."""
    from edgemoe.runtime.engine import Engine

    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "uncalibrated-qwen3moe.gguf"
    shutil.copy(QWEN, model)
    opened: list[Path] = []
    init = Engine.__init__

    def counted(self: Engine, *args: object, **kw: object) -> None:
        opened.append(Path(str(args[0])))
        init(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "__init__", counted)
    notes: list[str] = []
    with open_engine(model, expert_slots=4, policy="static", n_ctx=256, n_threads=1, notify=notes.append) as eng:
        assert eng.experts is not None and type(eng.experts.policy).__name__ == "StaticPolicy"
    assert opened == [model]
    assert (tmp_path / "cache" / "calibration").is_dir()
    assert any("policy static" in n for n in notes), notes
