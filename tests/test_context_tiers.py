"""Context tiers (edgemoe.runtime.context_tiers, edgemoe.plan.tiers): the context created in steps as the
sequence grows, each step's unused KV bytes as expert slots; the fallback for lending the KV cache's unwritten
cells. The logits equal stock llama.cpp's at every length, across every step, with truncations, KV snapshots
restored and new prompts in between, as serve does."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.errors import InvalidConfigError, ModelLoadError
from edgemoe.gguf.info import ModelInfo, read_model_info
from edgemoe.gguf.kv_types import KvTypes
from edgemoe.placement import cache_request, plan
from edgemoe.plan.reserve import budget_for_slots
from edgemoe.plan.tiers import context_steps
from edgemoe.runtime.cache_config import CacheConfig, ExpertCacheError, LruConfig
from edgemoe.runtime.context_tiers import ContextResizer, ContextTier, ContextTiers, check_tiers
from edgemoe.runtime.engine import Engine
from edgemoe.runtime.sampling import GREEDY

from helpers.models import FIXTURE_MODELS
from helpers.tiers_walk import CFG, tiers_for, walk_steps

TIERS = ContextTiers((ContextTier(256, 12), ContextTier(512, 8), ContextTier(1024, 4)))


# -- the tier rules, over fakes ----------------------------------------------------------------------------------
@dataclass
class FakeHandle:
    n_ctx: int
    fail_at: int | None = None
    made: list[int] = field(default_factory=list)

    def resize(self, n_ctx: int) -> None:
        if n_ctx == self.fail_at:
            self.made.append(self.n_ctx)  # made again at the old size
            raise ModelLoadError("out of memory")
        self.n_ctx = n_ctx
        self.made.append(n_ctx)


class FakeRouting:
    def __init__(self) -> None:
        self.cache_config: CacheConfig | None = CacheConfig(4)
        self.cache_device: object = None
        self.experts = None
        self.opened: list[object] = []

    def close_experts(self) -> None:
        self.opened.append("closed")

    def enable_expert_cache(self, config: CacheConfig, device: object) -> None:
        self.opened.append(config.slots_per_layer)

    def rewire(self) -> None:
        self.opened.append("rewired")


class FakePrefetch:
    def reapply(self) -> None:
        pass


class FakeCarry:
    def __init__(self) -> None:
        self.log: list[str] = []

    def save(self, n: int) -> object:
        self.log.append(f"save {n}")
        return n

    def cleared(self) -> None:
        self.log.append("cleared")

    def load(self, snap: object) -> None:
        self.log.append(f"load {snap}")


def _resizer(fail_at: int | None = None) -> tuple[ContextResizer, FakeHandle, FakeRouting, FakeCarry]:
    handle, routing, carry = FakeHandle(1024, fail_at), FakeRouting(), FakeCarry()
    r = ContextResizer(handle, routing, FakePrefetch(), TIERS, carry=carry)  # type: ignore[arg-type]
    return r, handle, routing, carry


def test_grows_only_when_needed_carries_what_is_kept_and_starts_small_when_nothing_is() -> None:
    r, handle, routing, carry = _resizer()
    r.fit(1, 0)  # an empty sequence: the smallest tier
    assert handle.n_ctx == 256 and routing.opened == ["closed", 12] and carry.log == ["cleared"]
    r.fit(256, 200)  # fits: nothing happens
    assert handle.made == [256]
    r.fit(300, 256)  # outgrows it: the next tier, the 256 tokens carried over
    assert handle.n_ctx == 512 and routing.opened[-1] == 8 and carry.log[-3:] == ["save 256", "cleared", "load 256"]
    r.fit(100, 90)  # tokens kept: never smaller
    assert handle.n_ctx == 512
    r.fit(1000, 600)
    assert handle.n_ctx == 1024 and routing.opened[-1] == 4
    r.fit(2000, 1000)  # past the last tier: left to the caller's overflow check
    assert handle.n_ctx == 1024
    r.fit(100, 0)  # a new prompt that keeps nothing: back to the smallest that holds it
    assert handle.n_ctx == 256 and carry.log[-1] == "cleared"
    assert [(x.from_ctx, x.to_ctx, x.tokens) for x in r.resizes] == [
        (1024, 256, 0), (256, 512, 256), (512, 1024, 600), (1024, 256, 0)]


def test_a_step_llama_cpp_cannot_make_leaves_the_old_context_with_what_it_held() -> None:
    r, handle, routing, carry = _resizer(fail_at=512)
    r.fit(1, 0)
    with pytest.raises(ModelLoadError):
        r.fit(300, 256)
    assert handle.n_ctx == 256 and r.current.n_ctx == 256
    assert routing.opened[-1] == 4 or routing.opened[-1] == 12  # the cache as it was configured
    assert carry.log[-3:] == ["save 256", "cleared", "load 256"]


def test_tiers_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match="increasing"):
        ContextTiers((ContextTier(512), ContextTier(256)))
    with pytest.raises(InvalidConfigError, match="the last must be"):
        check_tiers(TIERS, n_ctx=2048, n_batch=64)
    with pytest.raises(InvalidConfigError, match="fewer tokens than a batch"):
        check_tiers(TIERS, n_ctx=1024, n_batch=512)
    with pytest.raises(ExpertCacheError, match="use 0..8"):
        check_tiers(TIERS, n_ctx=1024, n_batch=64, moe_layers=[0, 1], n_expert=8)
    assert TIERS.tier_for(257) == ContextTier(512, 8) and TIERS.tier_for(1025) is None


# -- the plan's steps ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen30b_info(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    from edgemoe.gguf.synth import write_synthetic

    out = tmp_path_factory.mktemp("tiers") / "qwen3-30b-a3b-12.gguf"
    return read_model_info(write_synthetic("qwen3-30b-a3b", out, layers=12, shape_only=True, progress=False))


def test_steps_keep_only_contexts_that_give_slots_and_end_at_the_context(qwen30b_info: ModelInfo) -> None:
    info = qwen30b_info
    budget = budget_for_slots(info, 60, 32768)
    steps = context_steps(info, budget, 32768, KvTypes())
    assert [s.n_ctx for s in steps] == [4096, 16384, 32768]
    assert steps[-1].slots_per_layer == 60
    assert steps[0].slots_per_layer > steps[1].slots_per_layer > 60
    assert all(s.expert_budget_bytes > 0 for s in steps)
    # a quantized KV cache costs less per token: smaller steps gain fewer slots
    q8 = context_steps(info, budget, 32768, KvTypes("q8_0", "q8_0"))
    assert q8[0].slots_per_layer - q8[-1].slots_per_layer < steps[0].slots_per_layer - steps[-1].slots_per_layer
    assert context_steps(info, budget, 4096, KvTypes()) == ()  # nothing below the context
    assert context_steps(info, budget, 32768, KvTypes(), n_batch=8192)[0].n_ctx == 16384


# -- on the engine: bitwise against stock ------------------------------------------------------------------------
@pytest.mark.parametrize("path", FIXTURE_MODELS, ids=lambda p: p.stem)
def test_logits_equal_stock_across_every_step(path: Path) -> None:
    rng = np.random.default_rng(1)
    with Engine(path, CFG) as eng:
        ids = [int(x) for x in rng.integers(10, eng.n_vocab - 10, 1100)]
        ref = walk_steps(eng, ids)
    with Engine(path, CFG) as eng:
        n_expert = eng.info.n_expert
        eng.enable_expert_cache(CacheConfig(n_expert // 4, policy=LruConfig()))
        resizer = eng.set_context_tiers(tiers_for(n_expert))
        assert resizer is not None and eng.handle.n_ctx == 256 and eng.n_ctx == 1024
        assert set(eng.experts.cache.n_slots.values()) == {n_expert * 3 // 4}  # type: ignore[union-attr]
        got = walk_steps(eng, ids)
        steps = [(r.from_ctx, r.to_ctx) for r in resizer.resizes]
        assert steps[:3] == [(1024, 256), (256, 512), (512, 1024)], steps
        assert (1024, 256) in steps[3:] and steps[-1][1] == 1024, steps  # the new prompt, then the restore
        assert eng.experts is not None and eng.experts.stats()["hits"] > 0
        eng.set_context_tiers(None)
        assert eng.handle.n_ctx == 1024 and eng.kv_cache is not None
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert np.array_equal(a, b), (path.name, i)


def test_generation_through_a_step_equals_stock_and_splits_its_hit_rates() -> None:
    path = FIXTURE_MODELS[0]
    with Engine(path, CFG) as eng:
        prompt = eng.tokenize("ROMEO:\nBut soft, what light through yonder window breaks? " * 30)[:240]
        ref = eng.generate(prompt, max_tokens=40, sampling=GREEDY, ignore_eog=True).tokens
    with Engine(path, CFG) as eng:
        eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4, policy=LruConfig()))
        eng.set_context_tiers(tiers_for(eng.info.n_expert))
        g = eng.generate(prompt, max_tokens=40, sampling=GREEDY, ignore_eog=True)  # grows to 512 while decoding
        assert g.tokens == ref
        assert len(prompt) == 240 and eng.handle.n_ctx == 512
        assert eng.tiers is not None and eng.tiers.resizes[-1].tokens == 256
        assert eng.experts is not None and eng.experts.stats()["decode_hit_rate"] is not None


# -- the plan and open_engine --------------------------------------------------------------------------------------
def test_open_engine_with_a_budget_plans_and_runs_the_steps() -> None:
    import edgemoe

    path = FIXTURE_MODELS[0]
    info = read_model_info(path)
    budget = budget_for_slots(info, info.n_expert // 4, 32768)
    p = plan(edgemoe.gguf.header.check_gguf(path), cache_request(vram=budget), n_ctx=32768, device=None)
    assert [s.n_ctx for s in p.context_steps][-1] == 32768 and len(p.context_steps) > 1
    assert any("grows in steps" in n for n in p.notes)
    off = plan(edgemoe.gguf.header.check_gguf(path), cache_request(vram=budget, context_tiers=False), n_ctx=32768,
               device=None)
    assert off.context_steps == () and not any("grows in steps" in n for n in off.notes)
    with edgemoe.open_engine(path, vram=budget, n_ctx=32768, n_threads=2) as eng:
        assert eng.tiers is not None and eng.handle.n_ctx == p.context_steps[0].n_ctx and eng.n_ctx == 32768
        slots = eng.experts.cache.n_slots  # type: ignore[union-attr]
        assert min(slots.values()) == p.context_steps[0].slots_per_layer > p.slots_per_layer  # type: ignore[operator]


def test_cli_takes_no_context_tiers() -> None:
    from edgemoe.cli import cli

    res = CliRunner().invoke(cli, ["generate", "--help"])
    assert "--no-context-tiers" in res.output


def test_tiers_on_the_rpc_device_equal_stock(tmp_path: Path) -> None:
    """The cache on a device that is not the CPU (llama.cpp's RPC backend on loopback), and the GPU layout whose KV
    cache lives on that device: each step re-creates it there."""
    from helpers.rpc_child import run_child

    for path in FIXTURE_MODELS:
        out = run_child("rpc_tiers_check.py", path, tmp_path)
        assert out["device"].startswith("RPC"), out
        for layout in ("standin", "gpu_layout"):
            assert out[f"{layout}_equal"], (path.name, layout, out[layout])
            steps = [tuple(r[:2]) for r in out[layout]["resizes"]]
            assert steps[:3] == [(1024, 256), (256, 512), (512, 1024)], (layout, steps)
            assert out[layout]["stats"]["hits"] > 0, out[layout]
            checks = out[layout]["ids_check"]
            assert checks["n_rows"] > 0 and checks["n_negative"] == checks["n_range"] == checks["n_repeat"] == 0
        # the same tokens through an LRU of more slots: never fewer hits (LRU's inclusion property), here more
        rates = out["short_hit_rate"]
        assert rates["tiers"] > rates["whole"], (path.name, rates)
        print(path.name, "decode hit rate of a short conversation, tiers vs whole context:", rates)


def test_simulate_takes_the_kv_cache_types() -> None:
    """simulate plans the KV cache of -ctk/-ctv as plan does (a q8_0 cache leaves the slots more), and refuses a
    quantized V cache without flash attention."""
    import json

    from edgemoe.cli import cli

    path = FIXTURE_MODELS[-1]
    info = read_model_info(path)
    vram = str(budget_for_slots(info, 4, 8192))
    args = ["simulate", str(path), "--profile", "rtx4060-laptop", "--vram", vram, "--ctx", "8192", "--json"]
    runner = CliRunner()
    f16 = json.loads(runner.invoke(cli, args, catch_exceptions=False).output)
    q8 = json.loads(runner.invoke(cli, [*args, "-ctk", "q8_0", "-ctv", "q8_0"], catch_exceptions=False).output)
    assert q8["slots_per_layer"] > f16["slots_per_layer"] == 4
    bad = runner.invoke(cli, [*args, "-ctv", "q8_0", "-fa", "off"])
    assert bad.exit_code != 0 and "needs flash attention" in bad.output


def test_bench_runs_a_tiers_row() -> None:
    """bench --ctx N --context-tiers: each policy's first row again with the context created in steps."""
    import json

    from edgemoe.cli import cli

    path = FIXTURE_MODELS[0]
    info = read_model_info(path)
    budget = budget_for_slots(info, info.n_expert // 4, 32768)
    args = ["bench", str(path), "--vram", str(budget), "--prompt-tokens", "48", "--gen-tokens", "4", "--policy", "lru",
            "--ctx", "32768", "--context-tiers", "-t", "2", "--json"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output[res.output.index("{"):])["rows"]}
    plain = next(r for n, r in rows.items() if n.startswith("edgemoe lru") and "+" not in n)
    tiers = next(r for n, r in rows.items() if n.startswith("edgemoe lru") and n.endswith(" +tiers"))
    assert tiers["decode_tps"] > 0 and plain["decode_tps"] > 0 and "skipped" not in tiers["note"], tiers
    assert f"steps 16384:{info.n_expert}/32768:{info.n_expert // 4}" in tiers["note"], tiers["note"]
    # the short bench runs at the 16384 step, where every expert has a slot; the whole context leaves fewer
    assert set(tiers["cache"]["slots_per_layer"].values()) == {info.n_expert}
    assert sum(plain["cache"]["slots_per_layer"].values()) < sum(tiers["cache"]["slots_per_layer"].values())


def test_a_snapshot_of_the_whole_context_restores_into_a_smaller_step() -> None:
    """A state holding every cell of the context, restored while a new prompt keeps the context at its smallest
    step: the context grows to the last step (there is no room for a next token, but the state fits)."""
    path = FIXTURE_MODELS[0]
    with Engine(path, CFG) as eng:
        eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4, policy=LruConfig()))
        eng.set_context_tiers(tiers_for(eng.info.n_expert))
        ids = [int(x) for x in np.random.default_rng(3).integers(10, eng.n_vocab - 10, eng.n_ctx)]
        eng.feed(ids)
        full = eng.snapshot()
        eng.prefill(ids[500:540])  # shares nothing: back to the smallest step
        assert eng.handle.n_ctx == 256
        eng.restore(full)
        assert eng.kv_tokens() == tuple(ids) and eng.handle.n_ctx == eng.n_ctx


def test_models_whose_output_a_re_created_context_changes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """deepseek4 (its KV state does not carry over exactly) and LongRoPE models (llama.cpp picks their rope
    factors by the context's size) get no steps: the plan says why, and Engine.set_context_tiers refuses (the arch
    sweep's context-tiers check runs both on the random-weight models)."""
    from types import SimpleNamespace

    import edgemoe
    from edgemoe.plan import planner
    from edgemoe.runtime.context_tiers import INEXACT, LONGROPE, tiers_refusal

    def header(arch: str, *names: str) -> object:
        return SimpleNamespace(architecture=arch, tensors=tuple(SimpleNamespace(name=n) for n in names))

    assert tiers_refusal(header("deepseek4", "blk.0.attn_q.weight")) == INEXACT["deepseek4"]  # type: ignore[arg-type]
    assert tiers_refusal(header("phimoe", "rope_factors_long.weight")) == LONGROPE  # type: ignore[arg-type]
    assert tiers_refusal(header("qwen3moe", "blk.0.attn_q.weight")) is None  # type: ignore[arg-type]
    path = FIXTURE_MODELS[0]
    budget = budget_for_slots(read_model_info(path), 2, 32768)
    monkeypatch.setattr(planner, "tiers_refusal", lambda h: LONGROPE)
    p = plan(edgemoe.gguf.header.check_gguf(path), cache_request(vram=budget), n_ctx=32768, device=None)
    assert p.context_steps == () and f"note: the context is created whole (no context tiers): {LONGROPE}" in p.notes
