"""CUDA checks (run on the GPU machine: `make test PYTEST_ARGS='-m gpu'` after `make install EDGEMOE_CUDA=1`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.runtime import native
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.supports_gpu_offload(), reason="llama.cpp was built without a GPU backend"),
]

PROMPT = "ROMEO:\nWhat light through yonder window"


def test_greedy_equals_stock_on_gpu(fixture_model: Path) -> None:
    import llama_cpp

    with Engine(fixture_model, LoadConfig(n_ctx=512, n_gpu_layers=999)) as eng:
        g = eng.generate(PROMPT, max_tokens=48, sampling=GREEDY)
    assert eng.flash_attn == "on"  # "auto" on CUDA, as the stock run below
    llm = llama_cpp.Llama(model_path=str(fixture_model), n_ctx=512, n_gpu_layers=-1, flash_attn=True, verbose=False)
    stock = []
    for tok in llm.generate(g.prompt_tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
        stock.append(tok)
        if len(stock) >= len(g.tokens):
            break
    llm.close()
    assert g.tokens == stock


def test_gpu_logits_close_to_cpu(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_gpu_layers=999)) as eng:
        ids = eng.tokenize(PROMPT)
        gpu = np.array(eng.eval_logits(ids))
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_gpu_layers=0)) as eng:
        cpu = np.array(eng.eval_logits(ids))
    nmse = ((gpu - cpu) ** 2).mean() / (cpu ** 2).mean()
    assert nmse < 1e-3, nmse


# -- expert cache on CUDA (skipped ids, the cache and its asynchronous loads): the CPU-only suite checks the same on the stand-in ----------
CACHE_PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False, n_gpu_layers=999)


def _steps(eng: Engine, toks: list[int]) -> list[np.ndarray]:
    out = []
    for t in toks:
        eng.feed([t])
        out.append(np.array(eng.logits(-1)))
    return out


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a - b) ** 2).mean() / (b ** 2).mean())


@pytest.mark.parametrize("slots,policy", [(0, "manual"), (2, "lru"), (4, "lru"), (8, "static")])
def test_cache_on_gpu_close_to_experts_on_cpu(fixture_model: Path, slots: int, policy: str) -> None:
    """Experts split between the GPU cache and the CPU: NMSE vs all experts on the CPU (-ot exps=CPU)."""
    from edgemoe.calibration.adaptive import default_calibration_dir
    from edgemoe.runtime.cache_config import CacheConfig, calibrated_config

    with Engine(fixture_model, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_gpu_layers=999)) as eng:
        moe = tuple(eng.info.moe_layers)
    cfg = LoadConfig(**CACHE_PLAIN, cpu_expert_layers=moe)
    with Engine(fixture_model, cfg) as eng:
        toks = eng.tokenize(PROMPT * 4)[:60]
        ref = np.array(eng.eval_logits(toks))
        steps_ref = _steps(eng, toks[-8:])
    with Engine(fixture_model, cfg) as eng:
        cal = default_calibration_dir(fixture_model)
        cache = eng.enable_expert_cache(CacheConfig(slots, policy=calibrated_config(policy, cal)),
                                        device=native.gpu_device())
        got = np.array(eng.eval_logits(toks))  # prefill: ubatch of 60 (MMQ / MMF paths)
        steps = _steps(eng, toks[-8:])  # ubatch 1 (MMVQ)
        st = cache.stats()
    assert _nmse(got, ref) < 1e-4, _nmse(got, ref)
    for a, b in zip(steps, steps_ref, strict=False):
        assert _nmse(a, b) < 1e-4
    if slots:
        assert st["hits"] > 0



@pytest.mark.parametrize("prefill", [0, 16])
def test_cache_hands_the_gpu_valid_distinct_ids(fixture_model: Path, prefill: int) -> None:
    """The id-row checker on CUDA (docs/architecture.md, "Id rows on a device"): a 60-token prompt (MMQ) and
    single-token steps (MMVQ) through the lru cache, with and without device prefill, hand the GPU's mul_mat_id and
    add_id only valid ids, none repeated within a token's row; and the logits stay close to the CPU's experts'."""
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_gpu_layers=999)) as eng:
        moe = tuple(eng.info.moe_layers)
        n_expert = eng.info.n_expert
    cfg = LoadConfig(**CACHE_PLAIN, cpu_expert_layers=moe)
    with Engine(fixture_model, cfg) as eng:
        toks = eng.tokenize(PROMPT * 4)[:60]
        ref = np.array(eng.eval_logits(toks))
    with Engine(fixture_model, cfg) as eng:
        eng.set_ids_check(True)
        eng.enable_expert_cache(CacheConfig(max(1, n_expert // 4), policy=LruConfig(), prefill_min_tokens=prefill),
                                device=native.gpu_device())
        got = np.array(eng.eval_logits(toks))
        _steps(eng, toks[-8:])
        check = eng.ids_check()
    assert check["n_nodes"] > 0 and check["n_rows"] > 0, check
    assert check["n_negative"] == check["n_range"] == check["n_repeat"] == 0, check
    assert _nmse(got, ref) < 1e-4, _nmse(got, ref)

def _gpu_cache_run(path: Path, config: object) -> tuple[list[np.ndarray], dict, dict]:
    """The GPU layout (every layer offloaded, routed experts in CPU memory) with the cache `config` on the GPU:
    (prefill logits and 8 single-token steps', the cache's stats, the control counters)."""
    with Engine(path, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_gpu_layers=999)) as eng:
        moe = tuple(eng.info.moe_layers)
    with Engine(path, LoadConfig(**CACHE_PLAIN, cpu_expert_layers=moe)) as eng:
        cache = eng.enable_expert_cache(config, device=native.gpu_device())  # type: ignore[arg-type]
        assert cache is not None
        eng.reset_control_stats()
        toks = eng.tokenize(PROMPT * 4)[:60]
        got = [np.array(eng.eval_logits(toks[:-8])), *_steps(eng, toks[-8:])]
        return got, cache.stats(), eng.control_stats()


def test_overlap_on_gpu_equals_serial(fixture_model: Path) -> None:
    """The CPU/GPU overlap on CUDA: the cached experts run while the CPU computes the others; the logits are the
    serial order's up to where the two halves are added (the device or the CPU), one overlapped split per
    MoE layer and ubatch."""
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        n_moe, n_expert = len(eng.info.moe_layers), eng.info.n_expert
    runs = {o: _gpu_cache_run(fixture_model, CacheConfig(n_expert // 2, policy=LruConfig(), overlap=o))
            for o in (True, False)}
    (on, _, st_on), (off, _, st_off) = runs[True], runs[False]
    for a, b in zip(on, off, strict=False):
        assert _nmse(a, b) < 1e-9
    assert st_on["n_overlap"] == st_on["n_ubatch"] * n_moe and st_off["n_overlap"] == 0, (st_on, st_off)
    assert st_on["n_host_syncs"] == 0


def test_load_worker_on_gpu(fixture_model: Path) -> None:
    """The load worker, staging buffers, policies on the load worker on CUDA: the load worker issues every chunk of the native LRU (on by default on
    a GPU) through pinned staging buffers and times the compute's waits for them, the logits stay within the
    cache's tolerance of the caller-issued run, and no host sync per layer."""
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        n_expert = eng.info.n_expert
    runs = {a: _gpu_cache_run(fixture_model, CacheConfig(n_expert // 4, policy=LruConfig(), async_loads=a))
            for a in (None, False)}
    (on, cs_on, st_on), (off, cs_off, _) = runs[None], runs[False]
    for a, b in zip(on, off, strict=False):
        assert _nmse(a, b) < 1e-4
    assert cs_on["worker_chunks"] == cs_on["chunks"] > 0 and cs_off["worker_chunks"] == 0, (cs_on, cs_off)
    # staging buffers: every chunk goes through a pinned staging buffer (CUDA has a host buffer type)
    assert cs_on["staged_chunks"] == cs_on["chunks"] and cs_off["staged_chunks"] == cs_off["chunks"], (cs_on, cs_off)
    assert st_on["n_host_syncs"] == 0
    # policies on the load worker: the worker times the compute stream's waits for the loads (CUDA events), none without it
    assert 0 < cs_on["load_waits_timed"] <= cs_on["load_waits"] and cs_off["load_waits_timed"] == 0, (cs_on, cs_off)
    assert cs_on["hits"] + cs_on["misses"] == cs_off["hits"] + cs_off["misses"], (cs_on, cs_off)


def test_gpu_skipped_ids_op_test_passes() -> None:
    """tests/native/test_mmid_skip.cpp covers CUDA when the library has it: its run must include CUDA cases."""
    import subprocess

    from helpers.native_ops import build_native

    exe = build_native("test_mmid_skip", Path(__import__("tempfile").mkdtemp()))
    out = subprocess.run([str(exe), "4"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "OK   CUDA0" in out.stdout


def test_gpu_backend_ops_cases_of_the_series_pass() -> None:
    """llama.cpp's test-backend-ops with the series' cases (skipped ids, moe_gate): CUDA against the CPU."""
    import tempfile

    from helpers.native_ops import run_backend_ops

    run_backend_ops(Path(tempfile.mkdtemp()), "CUDA0")


def test_native_promoe_on_gpu(fixture_model: Path) -> None:
    """Predicted prefetch, overlap with an eval callback on CUDA: promoe inside llama.cpp, the predictor in the graph on the GPU, the load worker issuing
    the predictions' chunks while the later layers compute; the logits within the cache's tolerance of the
    experts-on-CPU layout's, predictions issued and some in time, no Python hook."""
    from edgemoe.calibration.adaptive import default_calibration_dir
    from edgemoe.runtime.cache_config import CacheConfig, ManualConfig, PromoeConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        n_expert = eng.info.n_expert
    ref, _, _ = _gpu_cache_run(fixture_model, CacheConfig(0, policy=ManualConfig()))
    cfg = CacheConfig(n_expert // 4, policy=PromoeConfig(calibration=default_calibration_dir(fixture_model)))
    got, cs, st = _gpu_cache_run(fixture_model, cfg)
    for a, b in zip(got, ref, strict=False):
        assert _nmse(a, b) < 1e-4
    assert cs["worker_chunks"] > 0 and cs["hits"] > 0 and st["n_host_syncs"] > 0, (cs, st)
    assert st["n_overlap"] > 0, st  # overlap with an eval callback: the device's experts run beside the CPU's after each stop


@pytest.mark.parametrize("ahead", ["all", "routed"])
def test_device_prefill_on_gpu(fixture_model: Path, ahead: str) -> None:
    """Device prefill on CUDA: the prompt's ubatch runs the experts outside the slots on the GPU from the prefill buffers,
    copied one cached layer ahead by the load worker (or at each layer, routed); logits within the cache's tolerance
    of the experts-on-CPU layout's, every layer's experts copied, nothing late with all ahead."""
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        n_expert = eng.info.n_expert
    ref, _, _ = _gpu_cache_run(fixture_model, CacheConfig(0, policy=ManualConfig()))
    cfg = CacheConfig(n_expert // 4, policy=LruConfig(), prefill_min_tokens=8, prefill_ahead=ahead)
    got, cs, st = _gpu_cache_run(fixture_model, cfg)
    for a, b in zip(got, ref, strict=False):
        assert _nmse(a, b) < 1e-4
    assert st["n_host_syncs"] > 0, st


def test_precalc_on_gpu(fixture_model: Path) -> None:
    """Pre-calculation with the cache on CUDA: DAOP's pre-calculation from layer 2 (a quarter of the experts resident, the
    rest on the CPU) gives the CPU stand-in's logits within the cache's tolerance and takes about as many experts
    early; the two CPU ops run beside a graph whose router and tables are on the GPU."""
    from edgemoe.analysis.precalc_run import stepped_logits
    from edgemoe.policies.loads import Load
    from edgemoe.runtime.cache_config import CacheConfig, ManualConfig

    def run(device: object, layout: dict) -> tuple[np.ndarray, dict]:
        with Engine(fixture_model, LoadConfig(**layout)) as eng:
            n_resident = eng.info.n_expert // 4
            cache = eng.enable_expert_cache(CacheConfig(n_resident, policy=ManualConfig(), precalc_from=2),
                                            device=device)
            assert cache is not None
            for il in eng.info.moe_layers:
                for e in range(n_resident):
                    cache.load(Load(il, e, e))
            logits = stepped_logits(eng, eng.tokenize(PROMPT * 4)[:48], 16)
            st = cache.precalc_stats()
            assert st is not None
            return logits, st

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        moe = tuple(eng.info.moe_layers)
    ref, st_ref = run(None, dict(n_ctx=256, n_batch=64, n_ubatch=64))
    got, st = run(native.gpu_device(), dict(CACHE_PLAIN, cpu_expert_layers=moe))
    for a, b in zip(got, ref, strict=False):
        assert _nmse(a, b) < 1e-3
    assert st["layers"] == st_ref["layers"] > 0 and abs(st["used"] - st_ref["used"]) <= 0.05 * st_ref["used"], (st, st_ref)


def test_mtp_drafting_on_gpu(tmp_path: Path) -> None:
    """MTP heads (tiny-deepseek2-mtp) in the GPU layout with the lru cache on the GPU: every id row handed to the
    device is valid, and greedy output with MTP drafting equals greedy without it on the same engine, or leaves it
    only at a near-tie (a verification batch's kernels are not a single token's: docs/speculation.md)."""
    from edgemoe.gguf.info import read_model_info
    from edgemoe.gguf.synth import write_synthetic
    from edgemoe.runtime.cache_config import CacheConfig, LruConfig
    from edgemoe.speculation import SpeculationConfig

    model = write_synthetic("tiny-deepseek2-mtp", tmp_path / "mtp.gguf", progress=False)
    info = read_model_info(model)
    cfg = LoadConfig(**CACHE_PLAIN, cpu_expert_layers=tuple(info.moe_layers), load_mtp=True)
    with Engine(model, cfg) as eng:
        eng.set_ids_check(True)
        eng.enable_expert_cache(CacheConfig(info.n_expert // 4, policy=LruConfig()), device=native.gpu_device())
        want = eng.generate(PROMPT, max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        eng.reset()
        g = eng.generate(PROMPT, max_tokens=24, sampling=GREEDY, ignore_eog=True)
        check = eng.ids_check()
    assert g.speculation is not None and g.speculation.drafted > 0
    assert check["n_rows"] > 0 and check["n_negative"] == check["n_range"] == check["n_repeat"] == 0, check
    gap = g.speculation.min_top2_gap
    assert g.tokens == want or (gap is not None and gap < 0.05), (g.tokens, want, g.speculation)
