"""Synthetic GGUF writer: tensor plans, random quant blocks, determinism, llama.cpp loading."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants
from gguf.constants import Keys

from edgemoe.gguf import synth
from edgemoe.gguf.presets import QTYPES, Role, tensor_type
from edgemoe.gguf.randquant import SUPPORTED_TYPES, TARGET_STD, iter_random_tensor
from edgemoe.gguf.synth import PRESETS, plan_tensors, synthetic_vocab, write_synthetic

MakeGguf = Callable[..., Path]  # the make_tiny_gguf fixture
TINY_PRESETS = tuple(name for name, p in PRESETS.items() if p.tiny)
BIG_PRESETS = tuple(name for name, p in PRESETS.items() if not p.tiny)

Q = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[1]


def _plan(preset: str, layers: int | None = None, qtype: str = "Q4_K") -> dict[str, tuple[tuple[int, ...], Q]]:
    return {t.name: (t.shape, t.qtype) for t in plan_tensors(preset, layers=layers, qtype=qtype)}


# --------------------------------------------------------------------------- random blocks


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_random_blocks_dequantize_to_small_finite_weights(qtype: Q) -> None:
    n = 256 * 128
    data = np.concatenate(list(iter_random_tensor(qtype, n, np.random.default_rng(1), chunk_bytes=4096)))
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert data.nbytes == n // block * type_size
    w = quants.dequantize(data.reshape(1, -1), qtype)
    assert w.shape == (1, n)
    assert np.isfinite(w).all()
    assert 0.75 * TARGET_STD < float(w.std()) < 1.25 * TARGET_STD
    assert abs(float(w.mean())) < 0.1 * TARGET_STD
    assert float(np.abs(w).max()) < 0.2


def test_random_blocks_reject_partial_block() -> None:
    with pytest.raises(ValueError, match="not a multiple of Q4_K block size"):
        list(iter_random_tensor(Q.Q4_K, 100, np.random.default_rng(0)))


# --------------------------------------------------------------------------- plans of the real models


def test_big_preset_dimensions_match_the_released_configs() -> None:
    q3, mx, oss, ds, ol = (PRESETS[n] for n in BIG_PRESETS)
    assert (q3.n_layer, q3.n_embd, q3.n_expert, q3.n_expert_used, q3.n_ff_exp, q3.n_vocab) == (48, 2048, 128, 8, 768, 151936)
    assert (mx.n_layer, mx.n_embd, mx.n_expert, mx.n_expert_used, mx.n_ff, mx.n_vocab) == (32, 4096, 8, 2, 14336, 32000)
    assert (oss.n_layer, oss.n_embd, oss.n_expert, oss.n_expert_used, oss.n_ff_exp, oss.n_vocab) == (24, 2880, 32, 4, 2880, 201088)
    assert (ds.n_layer, ds.n_embd, ds.n_expert, ds.n_expert_used, ds.n_ff_exp, ds.n_expert_shared) == (27, 2048, 64, 6, 1408, 2)
    assert (ol.n_layer, ol.n_embd, ol.n_expert, ol.n_expert_used, ol.n_ff, ol.n_vocab) == (16, 2048, 64, 8, 1024, 50304)


def test_plan_qwen3_30b_a3b_shapes() -> None:
    plan = _plan("qwen3-30b-a3b", layers=1)
    assert plan["token_embd.weight"] == ((2048, 151936), Q.Q4_K)
    assert plan["output.weight"] == ((2048, 151936), Q.Q6_K)
    assert plan["blk.0.attn_q.weight"][0] == (2048, 32 * 128)
    assert plan["blk.0.attn_k.weight"][0] == (2048, 4 * 128)
    assert plan["blk.0.attn_output.weight"][0] == (32 * 128, 2048)
    assert plan["blk.0.attn_q_norm.weight"] == ((128,), Q.F32)
    assert plan["blk.0.ffn_gate_inp.weight"] == ((2048, 128), Q.F32)
    assert plan["blk.0.ffn_gate_exps.weight"] == ((2048, 768, 128), Q.Q4_K)
    assert plan["blk.0.ffn_down_exps.weight"] == ((768, 2048, 128), Q.Q4_K)
    assert len(plan_tensors("qwen3-30b-a3b")) == 3 + 48 * 12  # 579, as in the released GGUFs


def test_plan_mixtral_uses_feed_forward_length_for_experts() -> None:
    plan = _plan("mixtral-8x7b", layers=1)
    assert plan["blk.0.attn_k.weight"][0] == (4096, 1024)
    assert plan["blk.0.ffn_up_exps.weight"][0] == (4096, 14336, 8)
    assert plan["blk.0.ffn_down_exps.weight"][0] == (14336, 4096, 8)
    assert "blk.0.ffn_up.weight" not in plan


def test_plan_gpt_oss_mxfp4_experts_and_fallback_for_rows_of_2880() -> None:
    mx = _plan("gpt-oss-20b", layers=1, qtype="MXFP4")
    assert mx["blk.0.ffn_gate_exps.weight"] == ((2880, 2880, 32), Q.MXFP4)
    assert mx["blk.0.attn_q.weight"] == ((2880, 64 * 64), Q.Q8_0)
    assert mx["blk.0.attn_sinks.weight"] == ((64,), Q.F32)
    assert mx["blk.0.ffn_gate_exps.bias"] == ((2880, 32), Q.F32)
    assert mx["blk.0.post_attention_norm.weight"] == ((2880,), Q.F32)
    # 2880 is not a multiple of 256: llama-quantize falls back from Q4_K to Q5_0, Q6_K to Q8_0
    q4 = _plan("gpt-oss-20b", layers=1, qtype="Q4_K")
    assert q4["blk.0.ffn_down_exps.weight"] == ((2880, 2880, 32), Q.Q5_0)
    assert q4["output.weight"][1] == Q.Q8_0


def test_plan_deepseek_v2_lite_mla_dense_lead_and_shared_experts() -> None:
    plan = _plan("deepseek-v2-lite", layers=2)
    assert plan["blk.0.ffn_gate.weight"] == ((2048, 10944), Q.Q4_K)
    assert plan["blk.0.ffn_down.weight"] == ((10944, 2048), Q.Q5_0)  # 10944 % 256 != 0
    assert "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.1.attn_q.weight"][0] == (2048, 16 * 192)
    assert plan["blk.1.attn_kv_a_mqa.weight"][0] == (2048, 512 + 64)
    assert plan["blk.1.attn_kv_a_norm.weight"] == ((512,), Q.F32)
    assert plan["blk.1.attn_k_b.weight"] == ((128, 512, 16), Q.Q5_0)
    assert plan["blk.1.attn_v_b.weight"][0] == (512, 128, 16)
    assert plan["blk.1.attn_output.weight"][0] == (16 * 128, 2048)
    assert plan["blk.1.ffn_down_exps.weight"] == ((1408, 2048, 64), Q.Q5_0)
    assert plan["blk.1.ffn_up_exps.weight"] == ((2048, 1408, 64), Q.Q4_K)
    assert plan["blk.1.ffn_up_shexp.weight"][0] == (2048, 2 * 1408)
    assert plan["blk.1.ffn_down_shexp.weight"][0] == (2 * 1408, 2048)


def test_plan_olmoe_full_width_qk_norms() -> None:
    plan = _plan("olmoe-1b-7b", layers=1)
    assert plan["blk.0.attn_q_norm.weight"] == ((2048,), Q.F32)
    assert plan["blk.0.attn_k_norm.weight"] == ((2048,), Q.F32)
    assert plan["blk.0.ffn_up_exps.weight"][0] == (2048, 1024, 64)


@pytest.mark.parametrize("preset", BIG_PRESETS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_plan_types_fit_their_rows(preset: str, qtype: str) -> None:
    for t in plan_tensors(preset, layers=2, qtype=qtype):
        assert t.shape[0] % GGML_QUANT_SIZES[t.qtype][0] == 0, t
        if t.role in (Role.NORM, Role.SMALL):
            assert t.qtype == Q.F32, t


def test_tensor_type_follows_llama_quantize_fallbacks() -> None:
    assert tensor_type(Role.EXPERT, (256, 8, 4), "Q4_K") == Q.Q4_K
    assert tensor_type(Role.EXPERT, (96, 8, 4), "Q4_K") == Q.Q5_0
    assert tensor_type(Role.EXPERT, (96, 8, 4), "Q5_K") == Q.Q5_1
    assert tensor_type(Role.EXPERT, (96, 8, 4), "Q6_K") == Q.Q8_0
    assert tensor_type(Role.ATTN, (40, 8), "Q8_0") == Q.F16
    assert tensor_type(Role.ATTN, (256, 8), "MXFP4") == Q.Q8_0
    assert tensor_type(Role.NORM, (256,), "Q4_K") == Q.F32


def test_unknown_names_fail_loudly() -> None:
    with pytest.raises(ValueError, match="unknown preset 'qwen9'.*tiny-qwen3moe"):
        plan_tensors("qwen9")
    with pytest.raises(ValueError, match="unsupported --type 'Q3_K'"):
        plan_tensors("tiny-qwen3moe", qtype="Q3_K")
    with pytest.raises(ValueError, match="`layers=3` is out of range"):
        plan_tensors("tiny-qwen3moe", layers=3)


# --------------------------------------------------------------------------- written files


def test_written_file_matches_plan(tiny_gguf: Path) -> None:
    reader = GGUFReader(tiny_gguf)
    preset = str(reader.fields[synth.SYNTH_KEY_PRESET].contents())
    plan = plan_tensors(preset)
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    for rt, pt in zip(reader.tensors, plan, strict=False):
        assert tuple(int(d) for d in rt.shape) == pt.shape, pt.name
        assert rt.tensor_type == pt.qtype, pt.name
        assert int(rt.n_bytes) == pt.nbytes, pt.name
    arch = PRESETS[preset].arch
    assert reader.fields[Keys.General.ARCHITECTURE].contents() == arch
    p = PRESETS[preset]
    assert reader.fields[Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents() == p.n_layer + p.n_nextn
    assert len(reader.fields[Keys.Tokenizer.LIST].data) == PRESETS[preset].n_vocab
    assert tiny_gguf.stat().st_size < 8 * 2**20


def test_written_weights_are_finite_and_norms_are_one(make_tiny_gguf: MakeGguf) -> None:
    reader = GGUFReader(make_tiny_gguf("tiny-deepseek2"))
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.name.endswith("norm.weight"):
            assert (w == 1.0).all(), t.name
        elif w.size >= 4096:
            assert 0.01 < float(w.std()) < 0.03, t.name


def test_same_seed_same_bytes(make_tiny_gguf: MakeGguf, tmp_path: Path) -> None:
    first = make_tiny_gguf("tiny-qwen3moe")
    again = write_synthetic("tiny-qwen3moe", tmp_path / "again.gguf", progress=False)
    other = write_synthetic("tiny-qwen3moe", tmp_path / "other.gguf", seed=1, progress=False)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert first.stat().st_size == other.stat().st_size


def test_layers_option_keeps_the_first_blocks(make_tiny_gguf: MakeGguf) -> None:
    reader = GGUFReader(make_tiny_gguf("tiny-deepseek2", layers=2))
    names = [t.name for t in reader.tensors]
    assert reader.fields["deepseek2.block_count"].contents() == 2
    assert "blk.1.ffn_up_exps.weight" in names and not any(n.startswith("blk.2.") for n in names)


def test_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "iter_random_tensor", fail)
    out = tmp_path / "x.gguf"
    with pytest.raises(KeyboardInterrupt):
        write_synthetic("tiny-qwen3moe", out, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_synthetic_vocab_is_byte_level_bpe() -> None:
    tokens, types, merges = synthetic_vocab(600)
    assert len(tokens) == len(types) == 600 and len(set(tokens)) == 600
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(special)] == 3  # CONTROL
    for merge in merges:
        assert merge.replace(" ", "") in tokens
    with pytest.raises(ValueError, match="too small"):
        synthetic_vocab(100)


# --------------------------------------------------------------------------- stock llama.cpp


def _run_llama(path: Path) -> tuple[list[int], int]:
    """Tokenize, evaluate and generate a few tokens; returns (prompt tokens, tokens generated)."""
    with closing(llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)) as llm:
        tokens = llm.tokenize(b"hello world", add_bos=False)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)])
        assert np.isfinite(logits).all() and float(np.abs(logits).max()) > 0
        generated = []
        for token in llm.generate(tokens, temp=0.0, reset=True):
            generated.append(token)
            if len(generated) == 4:
                break
        return tokens, len(generated)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_llama_cpp_loads_and_runs_tiny_preset(preset: str, make_tiny_gguf: MakeGguf) -> None:
    tokens, generated = _run_llama(make_tiny_gguf(preset))
    vocab, _, _ = synthetic_vocab(PRESETS[preset].n_vocab)
    assert [vocab[t] for t in tokens] == ["hello", "Ġ", "w", "o", "r", "l", "d"]
    assert generated == 4


@pytest.mark.parametrize(("preset", "qtype"), [("tiny-gpt-oss", "MXFP4"), ("tiny-qwen3moe", "Q8_0"),
                                               ("tiny-deepseek2", "Q6_K"), ("tiny-qwen2moe", "F16")])
def test_llama_cpp_runs_other_types(preset: str, qtype: str, make_tiny_gguf: MakeGguf) -> None:
    _run_llama(make_tiny_gguf(preset, qtype=qtype))


# --------------------------------------------------------------------------- CLI


def _cli():
    spec = importlib.util.spec_from_file_location("synth_gguf", REPO / "tools" / "synth_gguf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_cli_writes_and_lists(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "t.gguf"
    result = runner.invoke(_cli(), ["tiny-olmoe", "--out", str(out), "--type", "q8_0", "--quiet"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and out.exists()
    listing = runner.invoke(_cli(), ["--list"], catch_exceptions=False)
    assert "qwen3-30b-a3b" in listing.output and "16.1 GiB" in listing.output
    bad = runner.invoke(_cli(), ["tiny-olmoe", "--out", str(out), "--layers", "9"])
    assert bad.exit_code != 0 and "out of range" in bad.output
