"""The expert cache with expert biases (gpt-oss) and per-expert scales against stock.

As in test_expert_cache.py: the cache is the CPU buffer that stands in for a GPU and both sides load with
use_extra_bufts=False, so they run the same CPU kernels and equality is bitwise. Without biases and scales in the cache, the cache
refuses these layers ("experts with biases or scales are not supported by the expert cache").

Scales: llama.cpp loads `blk.N.ffn_{gate,up,down}_exps.scale` ([n_expert] F32, as NVFP4 files have) for any
architecture; qwen3moe and llama (mixtral) apply them in build_moe_ffn, gpt-oss does not (it takes biases).
The synthetic writer adds them with expert_scales=True, values in [0.5, 1.5].
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.verify import FnPolicy
from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.synth import write_synthetic
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.policies.residency import Load
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.expert_cache import EXPERT_TENSORS
from edgemoe.runtime.sampling import GREEDY

from helpers.cache_runs import PLAIN, TEXT, partial_copy_run, run_prefill_and_steps

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"  # the scripts run in processes of their own
ModelPath = Callable[[str], Path]

# (preset, qtype, expert scales)
MODELS = {
    "gpt-oss": ("tiny-gpt-oss", "Q4_K", False),
    "gpt-oss-mxfp4": ("tiny-gpt-oss", "MXFP4", False),  # the release's expert type
    "qwen3moe-scales": ("tiny-qwen3moe", "Q4_K", True),
    "mixtral-scales": ("tiny-mixtral", "Q8_0", True),
}


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory, make_tiny_gguf: Callable[..., Path]) -> ModelPath:
    root = tmp_path_factory.mktemp("bias_scale")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        preset, qtype, scales = MODELS[name]
        if name not in made:
            made[name] = (write_synthetic(preset, root / f"{name}.gguf", qtype=qtype, expert_scales=True,
                                          progress=False) if scales else make_tiny_gguf(preset, qtype=qtype))
        return made[name]

    return get


def _extra_tensors(path: Path) -> set[str]:
    """The kinds of bias/scale tensors the model's experts have."""
    return {n.split(".", 2)[2] for n in (t.name for t in check_gguf(path).tensors)
            if n.startswith("blk.") and n.split(".", 2)[2] in EXPERT_TENSORS[4:]}


def test_the_models_have_biases_or_scales(model_path: ModelPath, make_tiny_gguf: Callable[..., Path]) -> None:
    kinds = ("up", "gate", "down")
    assert _extra_tensors(model_path("gpt-oss")) == {f"ffn_{t}_exps.bias" for t in kinds}
    assert _extra_tensors(model_path("qwen3moe-scales")) == {f"ffn_{t}_exps.scale" for t in kinds}
    # llama.cpp applies them: the same weights without the scales give other logits
    logits = []
    for path in (model_path("qwen3moe-scales"), make_tiny_gguf("tiny-qwen3moe")):
        with Engine(path, LoadConfig(n_ctx=64)) as eng:
            logits.append(np.array(eng.eval_logits(list(range(1, 9)))))
    assert not np.allclose(*logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(MODELS))
def test_random_residency_with_biases_and_scales_equals_stock(name: str, model_path: ModelPath) -> None:
    """Random residency maps before every step (prefill ubatch of 64, then single-token decode steps), 1, E/2
    and E slots, the tables in the graph (native lru) and the routing callback (blocking lru): bitwise."""
    path = model_path(name)
    rng = np.random.default_rng(0)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        toks = (eng.tokenize(TEXT) * 2)[:76]
        n_expert = eng.info.n_expert
    ref_pre, ref_steps, _ = run_prefill_and_steps(path, toks)
    for blocking in (False, True):
        for slots in (1, n_expert // 2, n_expert):
            cfg = CacheConfig(slots, policy=LruConfig(blocking=blocking))
            pre, steps, st = run_prefill_and_steps(path, toks, cache=cfg, rng=rng)
            what = f"{name}: {slots} slots, {'callback' if blocking else 'tables'}"
            assert np.array_equal(pre, ref_pre), f"{what}: prefill"
            for i, (a, b) in enumerate(zip(steps, ref_steps, strict=False)):
                assert np.array_equal(a, b), f"{what}: decode step {i}"
            assert st is not None and st["hits"] > 0 and st["loads"] > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_lru_with_biases_and_scales_generates_as_stock(name: str, model_path: ModelPath) -> None:
    path = model_path(name)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        ref = eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True).tokens
        n_expert = eng.info.n_expert
    for blocking in (False, True):
        for slots in (1, n_expert // 2):
            with Engine(path, LoadConfig(**PLAIN)) as eng:
                cache = eng.enable_expert_cache(CacheConfig(slots, policy=LruConfig(blocking=blocking)))
                got = eng.generate(TEXT[:80], max_tokens=32, sampling=GREEDY, ignore_eog=True).tokens
                st = cache.stats()
                control = eng.control_stats()
            assert got == ref, f"{name}: {slots} slots, blocking={blocking}"
            assert st["hits"] > 0 and st["misses"] > 0
            if not blocking:
                assert control["n_host_syncs"] == 0


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3moe-scales"])
def test_bias_rows_and_scales_load_with_their_expert(name: str, model_path: ModelPath) -> None:
    """An expert is a chunk per stacked tensor, biases and scales included; each is its expert's slice."""
    path = model_path(name)
    header = check_gguf(path)
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        layer, n_expert = eng.info.moe_layers[0], eng.info.n_expert
        sizes = {t.name: t.nbytes // n_expert for t in header.tensors
                 if t.name.removeprefix(f"blk.{layer}.") in EXPERT_TENSORS}
        cache = eng.enable_expert_cache(CacheConfig(2, policy=ManualConfig()))
        cache.prefetch(Load(layer, 3, 1))
        assert cache.issue() == len(sizes) == 6  # gate, up, down and their 3 biases or 3 scales
        cache.sync()
        assert cache.slots(layer)[3] == 1
        st = cache.stats()
        assert (st["loads"], st["chunks"], st["bytes_uploaded"]) == (1, 6, sum(sizes.values()))


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3moe-scales"])
def test_partial_copies_with_biases_and_scales_are_never_computed(name: str, model_path: ModelPath) -> None:
    """Slots with some chunks of a new expert issued (a bias or scale row may be the stale one) stay out."""
    ref, got, st, n_first = partial_copy_run(model_path(name), np.random.default_rng(1), 8)  # 6 chunks each
    assert np.array_equal(got, ref)
    assert st["hits"] > 0 and st["misses"] > 0
    assert st["prefetches"] > st["loads"] - n_first  # some were left unfinished


def test_scales_with_dropped_slots(model_path: ModelPath) -> None:
    """A dropped slot (-1) has no scale to look up: drops in the graph, in the hook and with the cache."""
    path = model_path("qwen3moe-scales")
    toks = list(range(1, 40))
    with Engine(path, LoadConfig(n_ctx=128, expert_used_count=1, use_extra_bufts=False)) as eng:
        top1 = np.stack(eng.eval_logits(toks))
    for where in ("graph", "hook"):
        with Engine(path, LoadConfig(n_ctx=128, expert_used_count=4, use_extra_bufts=False)) as eng:
            policy = GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False)  # keeps the first expert only
            if where == "graph":
                assert eng.set_gating(policy) == "graph"
            else:
                eng.set_policies([policy])
            np.testing.assert_array_equal(np.stack(eng.eval_logits(toks)), top1, err_msg=where)

    def drop_last(r: RouteRecord) -> None:
        r.ids[:, -1] = -1
        r.weights[:, -1] = 0.0

    with Engine(path, LoadConfig(**PLAIN)) as eng:
        eng.set_policies([FnPolicy(drop_last)])
        ref = np.array(eng.eval_logits(toks))
    with Engine(path, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(4, policy=LruConfig(blocking=True)))
        eng.set_policies([FnPolicy(drop_last)])
        got = np.array(eng.eval_logits(toks))
        assert cache.stats()["hits"] > 0
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3moe-scales"])
def test_cache_with_biases_and_scales_beside_repacked_cpu_experts(name: str, model_path: ModelPath) -> None:
    """llama.cpp's default repacking on the CPU and the cache reading the GGUF: close, not bitwise."""
    path = model_path(name)
    with Engine(path, LoadConfig(n_ctx=256)) as eng:
        toks = eng.tokenize(TEXT)[:48]
        ref = np.array(eng.eval_logits(toks))
        ref_gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
    with Engine(path, LoadConfig(n_ctx=256)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 2, policy=LruConfig(blocking=True)))
        got = np.array(eng.eval_logits(toks))
        got_gen = eng.generate(TEXT[:60], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        assert cache.stats()["hits"] > 0
    nmse = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
    assert nmse < 1e-5, nmse
    assert got_gen == ref_gen


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "qwen3moe-scales"])
def test_cache_with_biases_and_scales_on_rpc_device_equals_stock(name: str, model_path: ModelPath,
                                                                  tmp_path: Path) -> None:
    """tests/helpers/rpc_cache_check.py (as test_cache_rpc.py runs it): a device of its own, async copies over
    a loader connection, and the CLI's GPU layout (biases and scales of the offloaded layers on the device)."""
    result = tmp_path / "rpc.json"
    cmd = [sys.executable, str(HELPERS / "rpc_cache_check.py"), str(model_path(name)), str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["device"].startswith("RPC"), out
    for key in ("sync_loads_equal", "async_loads_equal", "lru_generate_equal", "gpu_layout_equal"):
        assert out[key], (key, out)
    for key in ("sync_stats", "async_stats", "lru_stats", "gpu_layout_stats"):
        assert out[key]["hits"] > 0 and out[key]["misses"] > 0, (key, out[key])


@pytest.mark.slow
def test_gpt_oss_20b_shaped_mxfp4_cache_equals_stock(tmp_path: Path) -> None:
    """gpt-oss-20b's shapes (2 of 24 layers, 32 experts of 2880, MXFP4 experts, vocab 201088): lru with 8
    slots per layer generates as stock, and random residency gives stock's logits bitwise."""
    path = write_synthetic("gpt-oss-20b", tmp_path / "gpt-oss-20b-l2.MXFP4.gguf", layers=2, qtype="MXFP4",
                           progress=False)
    cfg = LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)
    with Engine(path, cfg) as eng:
        toks = (eng.tokenize(TEXT) * 2)[:72]
        ref = eng.generate(TEXT[:40], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
    with Engine(path, cfg) as eng:
        cache = eng.enable_expert_cache(CacheConfig(8, policy=LruConfig()))
        got = eng.generate(TEXT[:40], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        assert cache.stats()["hits"] > 0
    assert got == ref
    ref_pre, ref_steps, _ = run_prefill_and_steps(path, toks, decode_steps=8)
    pre, steps, st = run_prefill_and_steps(path, toks, cache=CacheConfig(8, policy=LruConfig()),
                                           rng=np.random.default_rng(0), decode_steps=8)
    assert np.array_equal(pre, ref_pre)
    assert all(np.array_equal(a, b) for a, b in zip(steps, ref_steps, strict=False))
    assert st is not None and st["hits"] > 0
