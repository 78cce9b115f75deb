"""Flash attention (auto | on | off) and the KV cache's types (f16, q8_0, q4_0, ...): the options reach llama.cpp,
what llama.cpp made is read back, the refusals, the drift flash attention brings, the plan's KV reserve."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.cli.main import cli
from edgemoe.errors import InvalidConfigError
from edgemoe.gguf.info import read_model_info
from edgemoe.gguf.kv_types import KV_CACHE_TYPES, KvTypes, kv_bytes
from edgemoe.plan.budget import estimate_kv_cache_bytes, slot_budget
from edgemoe.plan.reserve import VRAM_RESERVE
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.handle import flash_attn_resolved
from edgemoe.runtime.sampling import GREEDY

from helpers.models import FIXTURE_MODELS

MODEL = FIXTURE_MODELS[0]
PROMPT = "ROMEO:\nWhat light through yonder window"


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# -- LoadConfig --------------------------------------------------------------------------------------------------


def test_defaults_are_llama_cpps() -> None:
    cfg = LoadConfig()
    assert (cfg.flash_attn, cfg.cache_type_k, cfg.cache_type_v) == ("auto", "f16", "f16")


def test_old_bool_flash_attn_reads_as_on_off() -> None:
    assert LoadConfig(flash_attn=True).flash_attn == "on"  # type: ignore[arg-type]  # the old bool
    assert LoadConfig(flash_attn=False).flash_attn == "off"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"flash_attn": "yes"}, ["`flash_attn='yes'`", "auto, on, off"]),
        ({"cache_type_k": "q3_k"}, ["`cache_type_k='q3_k'`", "q8_0"]),
        ({"cache_type_v": "f32"}, ["`cache_type_v='f32'`", "f16"]),
    ],
)
def test_unknown_values_refused(kwargs: dict[str, str], words: list[str]) -> None:
    with pytest.raises(InvalidConfigError) as err:
        LoadConfig(**kwargs)  # type: ignore[arg-type]
    assert all(w in str(err.value) for w in words), err.value


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q5_1"])
def test_quantized_v_without_flash_attention_refused(kind: str) -> None:
    with pytest.raises(InvalidConfigError) as err:
        LoadConfig(flash_attn="off", cache_type_v=kind)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg and f"`cache_type_v={kind!r}`" in msg
    assert "`flash_attn='on'` or `flash_attn='auto'`" in msg and "`cache_type_v='f16'`" in msg
    LoadConfig(flash_attn="off", cache_type_k=kind)  # type: ignore[arg-type]  # a quantized K is llama.cpp's too


def test_head_size_the_blocks_do_not_divide_refused() -> None:
    cfg = LoadConfig(cache_type_k="q8_0")
    with pytest.raises(InvalidConfigError, match="blocks of 32 values do not divide this model's head size 80"):
        cfg.validate_kv_shape(n_embd_head_k=80, n_embd_head_v=80, mla=False)
    cfg.validate_kv_shape(n_embd_head_k=128, n_embd_head_v=80, mla=False)  # V is f16
    LoadConfig(flash_attn="off", cache_type_k="q8_0").validate_kv_shape(n_embd_head_k=80, n_embd_head_v=80, mla=False)
    with pytest.raises(InvalidConfigError, match="give both the same"):
        LoadConfig(cache_type_k="q8_0").validate_kv_shape(n_embd_head_k=576, n_embd_head_v=512, mla=True)


def test_auto_resolution_from_the_log() -> None:
    probe_on = ["resolve_fused_ops: Flash Attention enabled"]
    probe_off = ["resolve_fused_ops: Flash Attention not supported, set to disabled"]
    assert flash_attn_resolved(LoadConfig(), probe_on) == "on"
    assert flash_attn_resolved(LoadConfig(), probe_off) == "off"
    assert flash_attn_resolved(LoadConfig(), []) == "unknown"
    assert flash_attn_resolved(LoadConfig(flash_attn="off"), probe_on) == "off"
    # a quantized V: llama.cpp turns "auto" into on before any probe
    assert flash_attn_resolved(LoadConfig(cache_type_v="q8_0"), probe_off) == "on"


# -- what llama.cpp made -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KV_CACHE_TYPES)
def test_types_reach_llama_cpp_and_the_estimate_is_its_size(kind: str) -> None:
    cfg = LoadConfig(n_ctx=256, n_threads=2, cache_type_k=kind, cache_type_v=kind)  # type: ignore[arg-type]
    with Engine(MODEL, cfg) as eng:
        kv = eng.kv_cache
        assert kv is not None and (kv.type_k, kv.type_v) == (kind, kind)
        assert eng.flash_attn == "on"  # auto on the CPU backend (and forced by a quantized V)
        estimate = estimate_kv_cache_bytes(eng.info, eng.n_ctx, KvTypes(cfg.cache_type_k, kind))  # type: ignore[arg-type]
        assert kv.k_mib + kv.v_mib == pytest.approx(estimate / 2**20, abs=0.011)  # logged to 2 decimals
        assert eng.generate("KING:", max_tokens=4, sampling=GREEDY).tokens


def test_flash_attention_as_asked() -> None:
    with Engine(MODEL, LoadConfig(n_ctx=128, flash_attn="off", cache_type_k="q8_0")) as eng:
        assert eng.flash_attn == "off"
        assert eng.kv_cache is not None and (eng.kv_cache.type_k, eng.kv_cache.type_v) == ("q8_0", "f16")
    with Engine(MODEL, LoadConfig(n_ctx=128, flash_attn="on")) as eng:
        assert eng.flash_attn == "on"


def test_kv_bytes_follow_the_type() -> None:
    info = read_model_info(MODEL)
    f16 = estimate_kv_cache_bytes(info, 4096)
    assert estimate_kv_cache_bytes(info, 4096, KvTypes("q8_0", "q8_0")) * 16 == f16 * 8.5
    assert estimate_kv_cache_bytes(info, 4096, KvTypes("q4_0", "q4_0")) * 16 == f16 * 4.5
    assert kv_bytes("q8_0", 33) == 2 * 34  # whole blocks


def test_plan_reserve_shrinks_and_slots_grow() -> None:
    info = read_model_info(MODEL)
    n_ctx = 1024  # the KV cache a few slots are worth (the fixture has 8 experts a layer)
    budget = info.dense_bytes + estimate_kv_cache_bytes(info, n_ctx) + VRAM_RESERVE  # no slot at f16
    plans = {
        k: slot_budget(info, budget, n_ctx=n_ctx, reserve_bytes=VRAM_RESERVE, kv=KvTypes(k, k))
        for k in ("f16", "q8_0", "q4_0")
    }
    assert plans["f16"].experts_per_layer == 0
    assert plans["f16"].kv_cache_bytes > plans["q8_0"].kv_cache_bytes > plans["q4_0"].kv_cache_bytes
    assert 0 < plans["q8_0"].experts_per_layer < plans["q4_0"].experts_per_layer
    freed = plans["f16"].kv_cache_bytes - plans["q4_0"].kv_cache_bytes
    assert plans["q4_0"].experts_per_layer == min(info.n_expert, freed // plans["q4_0"].slot_bytes)


# -- flash attention's drift -------------------------------------------------------------------------------------

# measured (CPU, 2 threads): greedy 96 tokens with flash attention on and off first differ at the 28th token
# (qwen3moe) and the 55th (mixtral), where the off run's top-2 logits are 0.0075 and 0.17 apart; over one same token sequence the
# logits' NMSE is 1.9e-5 and 6.1e-5 (the CPU's flash attention accumulates V in f16).
SAME_TOKENS = 24
NMSE_BOUND = 2e-4
GAP_BOUND = 0.25  # a top-1 that flips had a runner-up within this of it


def test_flash_attention_changes_greedy_only_within_the_kernel_drift(fixture_model: Path) -> None:
    gen, logits = {}, {}
    for fa in ("on", "off"):
        with Engine(fixture_model, LoadConfig(n_ctx=512, n_threads=2, flash_attn=fa)) as eng:  # type: ignore[arg-type]
            assert eng.flash_attn == fa
            g = eng.generate(PROMPT, max_tokens=96, sampling=GREEDY)
            gen[fa] = (g.prompt_tokens, g.tokens)
    assert gen["on"][1][:SAME_TOKENS] == gen["off"][1][:SAME_TOKENS]
    tokens = gen["off"][0] + gen["off"][1]
    for fa in ("on", "off"):
        with Engine(fixture_model, LoadConfig(n_ctx=512, n_threads=2, flash_attn=fa)) as eng:  # type: ignore[arg-type]
            logits[fa] = np.array(eng.eval_logits(tokens))
    on, off = logits["on"], logits["off"]
    assert not np.array_equal(on, off)  # the kernels differ: this test is of how much
    nmse = float(((on - off) ** 2).mean() / (off**2).mean())
    assert nmse < NMSE_BOUND, nmse
    top2 = np.sort(off, axis=-1)[:, -2:]
    flipped = on.argmax(-1) != off.argmax(-1)
    assert (top2[flipped, 1] - top2[flipped, 0] < GAP_BOUND).all(), top2[flipped]


# -- the command line ----------------------------------------------------------------------------------------------


def test_generate_takes_the_options() -> None:
    res = run(
        "generate", str(MODEL), "-p", "KING:", "-n", "4", "--temp", "0", "--json", "--ctx", "256",
        "--flash-attn", "on", "-ctk", "q8_0", "--cache-type-v", "q4_0",
    )
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)["tokens"]) == 4


def test_generate_refuses_a_quantized_v_without_flash_attention() -> None:
    res = run("generate", str(MODEL), "-p", "KING:", "-n", "4", "--flash-attn", "off", "--cache-type-v", "q8_0")
    assert res.exit_code == 1
    assert "--cache-type-v q8_0 needs flash attention" in res.output and "Traceback" not in res.output
    assert "--flash-attn on or --flash-attn auto, or --cache-type-v f16" in res.output
    assert "cache_type_v" not in res.output and "flash_attn" not in res.output  # the CLI's names, not the API's


def test_perplexity_takes_the_options(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 8)
    res = run("perplexity", str(MODEL), "--input", str(text), "--ctx", "64", "--max-tokens", "128", "--json",
              "-ctk", "q4_0", "-ctv", "q4_0")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert (d["flash_attn"], d["cache_type_k"], d["cache_type_v"]) == ("on", "q4_0", "q4_0") and d["nll"] > 0


def test_inspect_plans_the_kv_cache_of_the_type() -> None:
    res = run("inspect", str(MODEL), "--vram", "1GiB", "--ctx", "4096", "-ctk", "q8_0", "-ctv", "q8_0")
    assert res.exit_code == 0, res.output
    assert "K q8_0, V q8_0" in res.output and "--cache-type-k q8_0 --cache-type-v q8_0" in res.output


def test_every_model_command_has_the_options() -> None:
    for name in ("generate", "chat", "serve", "bench", "perplexity", "trace", "predict-eval"):
        res = run(name, "--help")
        assert res.exit_code == 0
        assert all(o in res.output for o in ("--flash-attn", "--cache-type-k", "--cache-type-v")), name
    for name in ("inspect", "plan"):  # the plan's KV estimate
        res = run(name, "--help")
        assert "--cache-type-k" in res.output and "--cache-type-v" in res.output, name


def test_serve_runs_with_a_quantized_kv_cache(tmp_path: Path) -> None:
    from helpers.serve_harness import MODEL_ID, running

    log = tmp_path / "server.log"
    with running(log, "--flash-attn", "auto", "-ctk", "q8_0", "-ctv", "q8_0") as srv:
        messages = [{"role": "user", "content": "Hi"}]
        r = srv.client().chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.completion_tokens >= 1
    assert "flash attention on, KV cache K q8_0 V q8_0" in log.read_text()
