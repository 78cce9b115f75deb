"""Impossible hyper-parameters are refused in Python, with one line naming the key, before llama.cpp aborts.

Each case mutates one metadata key of a bundled fixture (tests/helpers/gguf_mutate.py) and checks the error
of `check_model`; the Engine and the CLI tests at the end check that both refuse before llama.cpp
opens the file. Subprocess tests pin what llama.cpp itself still aborts on.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as T

from edgemoe.errors import EdgeMoeError, InvalidConfigError, InvalidHyperparameterError, ModelLoadError
from edgemoe.gguf.header import check_gguf
from edgemoe.gguf.info import read_model_info
from edgemoe.gguf.validate import LLAMA_MAX_EXPERTS, check_model, validate_hparams

from helpers.gguf_mutate import GgufFile
from helpers.models import FIXTURE_MODELS

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)  # 8 layers, 32 experts, top-4
MIXTRAL = next(p for p in FIXTURE_MODELS if "mixtral" in p.name)  # arch "llama", 8 layers, 8 experts, top-2
U32, F32 = T.UINT32, T.FLOAT32
ROOT = Path(__file__).resolve().parents[1]


def mutated(tmp_path: Path, src: Path, edit: Callable[[GgufFile], object], name: str = "model.gguf") -> Path:
    f = GgufFile.read(src)
    edit(f)
    return f.write(tmp_path / name)


def arch_of(src: Path) -> str:
    return "qwen3moe" if src == QWEN else "llama"


# --------------------------------------------------------------------------- every rule

# (fixture, key without the "<arch>." prefix, type, value, what the message says)
Q, M = "qwen3moe", "llama"
CASES = [
    (QWEN, "expert_count", U32, 0,
     rf"{Q}\.expert_used_count is 4 but {Q}\.expert_count is 0; a model without routed experts routes "
     r"to none"),
    (QWEN, "expert_count", U32, 10**6, rf"{Q}\.expert_count is 1000000; llama\.cpp supports at most 1024 "),
    (QWEN, "expert_count", U32, 2,
     rf"{Q}\.expert_used_count is 4 but expert_count is 2; a model uses at most expert_count experts "
     r"per token"),
    (QWEN, "expert_used_count", U32, 0,
     rf"{Q}\.expert_used_count is 0 but expert_count is 32; a mixture-of-experts model routes each token to "
     r"at least 1 expert"),
    (QWEN, "expert_used_count", U32, 33, rf"{Q}\.expert_used_count is 33 but expert_count is 32"),
    (MIXTRAL, "expert_used_count", U32, 2**32 - 1,
     rf"{M}\.expert_used_count is 4294967295 but expert_count is 8"),
    (MIXTRAL, "expert_used_count", T.INT32, -1, rf"{M}\.expert_used_count is -1; it cannot be negative"),
    (QWEN, "expert_used_count", T.STRING, "4",
     rf"{Q}\.expert_used_count is the string '4'; it must be a whole number or one per layer"),
    (QWEN, "expert_group_count", U32, 3,
     rf"{Q}\.expert_group_count is 3 but expert_count 32 is not a multiple"),
    (QWEN, "expert_group_count", U32, 4,
     rf"{Q}\.expert_group_used_count is 0; with 4 expert groups a token uses 1\.\.3 of them"),
    (QWEN, "expert_group_count", U32, 32,
     rf"{Q}\.expert_group_count is 32 but expert_count is 32; there are fewer groups than experts"),
    (QWEN, "block_count", U32, 0, rf"{Q}\.block_count is 0; llama\.cpp loads 1\.\.512 layers"),
    (MIXTRAL, "block_count", U32, 1000, rf"{M}\.block_count is 1000; llama\.cpp loads 1\.\.512 layers"),
    (QWEN, "block_count", U32, 7,
     rf"{Q}\.block_count is 7 but the file has tensors of block 7 \(blk\.7\.\*\), so 8 blocks"),
    (QWEN, "block_count", U32, 9, rf"{Q}\.block_count is 9 but the file has tensors of blocks 0\.\.7 only"),
    (QWEN, "nextn_predict_layers", U32, 9, rf"{Q}\.nextn_predict_layers is 9 but block_count is 8"),
    (QWEN, "embedding_length", U32, 0, rf"{Q}\.embedding_length is 0; a model's hidden size is at least 1"),
    (QWEN, "context_length", U32, 0, rf"{Q}\.context_length is 0; the training context is at least 1 token"),
    (QWEN, "attention.head_count", U32, 0,
     rf"{Q}\.attention\.head_count is 0; a qwen3moe model has at least one attention head"),
    (QWEN, "attention.key_length", U32, 0,
     rf"{Q}\.attention\.key_length is 0; an attention head has at least 1 dimension"),
    (QWEN, "rope.dimension_count", U32, 1000,
     rf"{Q}\.rope\.dimension_count is 1000 but the key head size is 64; rope rotates at most the whole head"),
    (MIXTRAL, "rope.dimension_count", U32, 1000,
     rf"{M}\.rope\.dimension_count is 1000 but the key head size is 64"),
    (QWEN, "rope.dimension_count", U32, 32,
     rf"{Q}\.rope\.dimension_count is 32 but the head size is 64; qwen3moe models rotate the whole head"),
    (QWEN, "attention.value_length", U32, 128,
     rf"{Q}\.attention\.value_length is 128 but the key length is 64"),
    (QWEN, "attention.layer_norm_rms_epsilon", F32, float("nan"),
     r"layer_norm_rms_epsilon is nan; a normalization epsilon is a small positive number"),
    (MIXTRAL, "attention.layer_norm_rms_epsilon", F32, float("inf"),
     rf"{M}\.attention\.layer_norm_rms_epsilon is inf"),
    (QWEN, "attention.layer_norm_rms_epsilon", F32, -1.0, r"layer_norm_rms_epsilon is -1\.0;"),
    (QWEN, "attention.layer_norm_epsilon", F32, float("-inf"),
     rf"{Q}\.attention\.layer_norm_epsilon is -inf"),
    (QWEN, "attention.layer_norm_rms_epsilon", U32, 1, r"layer_norm_rms_epsilon is 1; it must be a number"),
    (QWEN, "rope.freq_base", F32, float("nan"),
     rf"{Q}\.rope\.freq_base is nan; a rope base frequency is a positive number"),
    (QWEN, "rope.scaling.type", T.STRING, "bogus",
     rf"{Q}\.rope\.scaling\.type is the string 'bogus'; llama\.cpp knows none, linear, yarn, longrope"),
]


@pytest.mark.parametrize(("src", "key", "vtype", "value", "message"), CASES,
                         ids=[f"{arch_of(c[0])}.{c[1]}={c[3]}" for c in CASES])
def test_each_rule(tmp_path: Path, src: Path, key: str, vtype: T, value: object, message: str) -> None:
    path = mutated(tmp_path, src, lambda f: f.set(f"{arch_of(src)}.{key}", vtype, value))
    with pytest.raises(InvalidHyperparameterError, match=message) as err:
        check_model(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert isinstance(err.value, ModelLoadError)  # existing handlers of load errors catch it


@pytest.mark.parametrize(("key", "message"), [
    ("block_count", r"the key qwen3moe\.block_count is missing; llama\.cpp needs it to load a qwen3moe "
                    r"model"),
    ("context_length", r"the key qwen3moe\.context_length is missing"),
    ("embedding_length", r"the key qwen3moe\.embedding_length is missing"),
    ("expert_count", r"qwen3moe\.expert_used_count is 4 but qwen3moe\.expert_count is missing"),
    ("expert_used_count", r"qwen3moe\.expert_used_count is missing but expert_count is 32"),
])
def test_missing_keys(tmp_path: Path, key: str, message: str) -> None:
    path = mutated(tmp_path, QWEN, lambda f: f.drop(f"qwen3moe.{key}"))
    with pytest.raises(InvalidHyperparameterError, match=message):
        check_model(path)


def test_per_layer_arrays(tmp_path: Path) -> None:
    ok = mutated(tmp_path, QWEN, lambda f: f.set_array("qwen3moe.expert_used_count", U32, [4] * 8), "ok.gguf")
    assert check_model(ok).metadata["qwen3moe.expert_used_count"] == (4,) * 8
    short = mutated(tmp_path, QWEN, lambda f: f.set_array("qwen3moe.attention.head_count_kv", U32, [2]))
    with pytest.raises(InvalidHyperparameterError, match=r"head_count_kv is \[2\], 1 values for 8 blocks; a "
                                                         r"per-layer value has one entry per block"):
        check_model(short)
    over = mutated(tmp_path, QWEN, lambda f: f.set_array("qwen3moe.expert_used_count", U32, [4] * 7 + [40]),
                   "over.gguf")
    with pytest.raises(InvalidHyperparameterError,
                       match=r"expert_used_count is \[4, 4, 4, 4, 4, 4, 4, 40\] but expert_count is 32"):
        check_model(over)


def test_a_one_item_array_reads_as_a_tuple(tmp_path: Path) -> None:
    # header.py used to return the bare number for a numeric array of one item (TypeError on read)
    path = mutated(tmp_path, QWEN, lambda f: f.set_array("x.one", U32, [7]))
    assert check_gguf(path).metadata["x.one"] == (7,)


def test_read_model_info_reports_a_mistyped_key_instead_of_raising(tmp_path: Path) -> None:
    path = mutated(tmp_path, QWEN, lambda f: f.set("qwen3moe.expert_used_count", T.STRING, "x"))
    assert read_model_info(path).n_expert_used == 0  # the info is lenient; check_model is not
    with pytest.raises(InvalidHyperparameterError, match="is the string 'x'"):
        check_model(path)


# --------------------------------------------------------------------------- what stays allowed


def test_fixtures_and_every_tiny_preset_pass(tiny_gguf: Path) -> None:
    for path in (*FIXTURE_MODELS, tiny_gguf):
        check_model(path)


def test_harmless_values_pass(tmp_path: Path) -> None:
    for i, edit in enumerate([
        lambda f: f.set("qwen3moe.expert_used_count", U32, 1),
        # llama.cpp then finds 32 in the tensors and says so
        lambda f: f.set("qwen3moe.expert_count", U32, LLAMA_MAX_EXPERTS),
        lambda f: f.set("qwen3moe.attention.layer_norm_rms_epsilon", F32, 1e-12),
        lambda f: f.set("qwen3moe.nextn_predict_layers", U32, 8),
        lambda f: f.set("qwen3moe.expert_group_count", U32, 4).set("qwen3moe.expert_group_used_count",
                                                                    U32, 2),
        lambda f: f.set("qwen3moe.rope.scaling.type", T.STRING, "yarn"),
        lambda f: f.drop("qwen3moe.rope.dimension_count").drop("qwen3moe.attention.key_length"),
    ]):
        check_model(mutated(tmp_path, QWEN, edit, f"ok{i}.gguf"))


def test_expert_used_count_equal_to_expert_count_is_allowed(tmp_path: Path) -> None:
    from edgemoe.runtime.engine import Engine, LoadConfig
    from edgemoe.runtime.sampling import SamplingParams

    path = mutated(tmp_path, MIXTRAL, lambda f: f.set("llama.expert_used_count", U32, 8))
    check_model(path)
    with Engine(path, LoadConfig(n_ctx=64, n_threads=1)) as eng:  # degenerate, but llama.cpp runs it
        assert eng.info.n_expert_used == eng.info.n_expert == 8
        assert len(eng.generate("hello", max_tokens=2, sampling=SamplingParams(temperature=0.0)).tokens) == 2


def test_the_override_replaces_the_files_value(tmp_path: Path) -> None:
    header = check_gguf(mutated(tmp_path, QWEN, lambda f: f.set("qwen3moe.expert_used_count", U32, 0)))
    with pytest.raises(InvalidHyperparameterError, match="expert_used_count is 0"):
        validate_hparams(header)
    validate_hparams(header, expert_used_count=2)  # llama.cpp's kv override applies before its check
    with pytest.raises(InvalidHyperparameterError,
                       match=r"is 33 \(the expert_used_count override\) but expert_count is 32; .*: "
                             r"pass 1\.\.32 or leave it unset"):
        validate_hparams(header, expert_used_count=33)


# --------------------------------------------------------------------------- llama.cpp's graph budget


def test_used_count_that_overflows_the_graph() -> None:
    """Every expert of every layer, with and without the expert cache (a second expert FFN per layer):
    llama.cpp's graph budget used to count tensors only and aborted from 31 of 32."""
    code = ("import sys; from edgemoe.runtime.engine import Engine, LoadConfig; "
            "from edgemoe.runtime.cache_config import CacheConfig, LruConfig\n"
            "from edgemoe.runtime.sampling import GREEDY\n"
            "for cache in (False, True):\n"
            "    with Engine(sys.argv[1], LoadConfig(n_ctx=256, n_threads=1, expert_used_count=32)) as eng:\n"
            "        if cache: eng.enable_expert_cache(CacheConfig(4, policy=LruConfig()))\n"
            "        assert len(eng.generate('hi', max_tokens=4, sampling=GREEDY, ignore_eog=True).tokens) == 4\n")
    r = subprocess.run([sys.executable, "-c", code, str(QWEN)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GGML_NO_BACKTRACE": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-800:]


# --------------------------------------------------------------------------- Engine, LoadConfig, CLI


def test_engine_refuses_before_llama_cpp(tmp_path: Path) -> None:
    from edgemoe.runtime.engine import Engine, LoadConfig

    path = mutated(tmp_path, QWEN, lambda f: f.set("qwen3moe.block_count", U32, 0))
    with pytest.raises(InvalidHyperparameterError, match="block_count is 0"):
        Engine(path, LoadConfig(n_ctx=64))
    for k in (100, 0, -1):
        with pytest.raises(InvalidConfigError, match=rf"expert_used_count {k}: use 1\.\.32"):
            Engine(QWEN, LoadConfig(n_ctx=64, expert_used_count=k))
    with pytest.raises(InvalidConfigError, match=r"100000 threads: use 1\.\.512"):
        Engine(QWEN, LoadConfig(n_ctx=64, n_threads=100000))


def test_llama_cpp_load_errors_are_one_line(tmp_path: Path) -> None:
    from edgemoe.runtime.engine import Engine, LoadConfig

    def shift(f: GgufFile) -> None:
        # gguf.c refuses the gap; check_gguf does not look for it
        f.tensor("blk.0.ffn_down_exps.weight").offset += 32

    with pytest.raises(ModelLoadError, match=r"could not load .*: gguf_init_from_reader: tensor 'blk\.0\."
                                             r"ffn_down_exps\.weight' has offset \d+, expected \d+") as err:
        Engine(mutated(tmp_path, QWEN, shift), LoadConfig(n_ctx=64))
    assert "\n" not in str(err.value)


def run_cli(*args: str):  # type: ignore[no-untyped-def]
    from edgemoe.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_inspect_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    path = mutated(tmp_path, MIXTRAL, lambda f: f.set("llama.expert_used_count", U32, 9))
    res = run_cli("inspect", str(path))
    assert res.exit_code == 1
    assert res.output == (f"Error: {path}: llama.expert_used_count is 9 but expert_count is 8; a model uses "
                          "at most expert_count experts per token: re-convert the model, or fix the key with "
                          "gguf-py's gguf_set_metadata.py\n")
    assert run_cli("inspect", str(MIXTRAL)).exit_code == 0


@pytest.mark.parametrize("threads", ["100000", "513", "-1"])
def test_threads_option_is_bounded(threads: str) -> None:
    res = run_cli("generate", str(QWEN), "-p", "hi", "-n", "1", "-t", threads)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "0<=x<=512" in res.output


def test_threads_at_the_bound_are_accepted() -> None:
    from edgemoe.runtime.config import MAX_THREADS, LoadConfig

    LoadConfig(n_threads=MAX_THREADS).validate(n_expert=8, n_expert_used=2)
    with pytest.raises(InvalidConfigError) as err:
        LoadConfig(n_threads=MAX_THREADS + 1).validate(n_expert=8, n_expert_used=2)
    assert isinstance(err.value, (EdgeMoeError, ValueError))


# --------------------------------------------------------------------------- tokenizers


def test_a_model_without_tokenizer_refuses_text_instead_of_aborting(tmp_path: Path) -> None:
    from edgemoe.runtime.engine import Engine, LoadConfig

    # the mixtral fixture states llama.vocab_size, so it loads with "no_vocab" (the qwen3moe one does not)
    path = mutated(tmp_path, MIXTRAL, lambda f: f.set("tokenizer.ggml.model", T.STRING, "no_vocab"))
    with Engine(path, LoadConfig(n_ctx=64, n_threads=1)) as eng:
        for call in (lambda: eng.tokenize("hi"), lambda: eng.token_piece(5),
                     lambda: eng.generate("hi", max_tokens=1)):
            with pytest.raises(EdgeMoeError, match=r"has no tokenizer \(tokenizer\.ggml\.model none or "
                                                   r"no_vocab\)"):
                call()
        eng.feed([1, 2, 3])  # token ids still work


def test_spm_tokenizer_without_byte_tokens(tmp_path: Path) -> None:
    """llama.cpp's SentencePiece tokenizer spells unknown characters with <0xNN> byte tokens and
    std::terminate()s when the vocabulary has none: the engine refuses such text with one line."""
    path = mutated(tmp_path, QWEN, lambda f: f.set("tokenizer.ggml.model", T.STRING, "llama"))
    code = ("import sys; from edgemoe.errors import EdgeMoeError; from edgemoe.runtime.engine import Engine, "
            "LoadConfig\ntry: Engine(sys.argv[1], LoadConfig(n_ctx=64, n_threads=1)).tokenize('hello')\n"
            "except EdgeMoeError as e: print(e); sys.exit(1)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GGML_NO_BACKTRACE": "1"}, cwd=ROOT)
    assert r.returncode == 1, r.stderr[-500:]
    assert "no byte tokens (<0x00>..<0xFF>)" in r.stdout and "'\u2581'" in r.stdout, r.stdout


def test_spm_guard_lets_text_through_that_needs_no_missing_byte() -> None:
    from edgemoe.runtime.vocab_guard import SpmByteGuard

    full = SpmByteGuard([f"<0x{b:02X}>".encode() for b in range(256)])
    assert not full.missing_bytes and full.unencodable("any text \u00e9") == []
    # pieces for h, i and the space; bytes only for ASCII (one-byte pieces count as byte tokens)
    part = SpmByteGuard([b"h", b"i", "\u2581".encode(), *(bytes([b]) for b in range(128))])
    assert part.missing_bytes == frozenset(range(128, 256))
    assert part.unencodable("hi hi") == []
    assert part.unencodable("hx") == []  # x: its one byte is a piece
    assert part.unencodable("h\u00e9 \u20ac") == ["\u00e9", "\u20ac"]  # no piece, high bytes missing


# --------------------------------------------------------------------------- tables vs the vendored llama.cpp

LLAMA_SRC = ROOT / ".build/src/llama_cpp_python-0.3.36/vendor/llama.cpp/src"


def _arch_names() -> dict[str, str]:
    import re

    table = (LLAMA_SRC / "llama-arch.cpp").read_text()
    return dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', table))


@pytest.mark.skipif(not LLAMA_SRC.exists(), reason="vendored llama.cpp source not unpacked")
def test_rope_is_head_architectures_match_the_vendored_graph_builders() -> None:
    import re

    from edgemoe.gguf.validate import ROPE_IS_HEAD_ARCHITECTURES

    classes: dict[str, str] = {}  # LLM_ARCH_X -> llama_model_x
    for cases, cls in re.findall(r"((?:case LLM_ARCH_\w+:\s*)+)return new (llama_model_\w+)\(",
                                 (LLAMA_SRC / "llama-model.cpp").read_text()):
        classes.update((arch, cls) for arch in re.findall(r"LLM_ARCH_\w+", cases))
    asserting = {cls for f in (LLAMA_SRC / "models").glob("*.cpp")
                 if "GGML_ASSERT(n_embd_head == n_rot)" in (text := f.read_text())
                 for cls in re.findall(r"(llama_model_\w+)::graph\b", text)}
    names = _arch_names()
    assert {names[a] for a, cls in classes.items() if cls in asserting} == ROPE_IS_HEAD_ARCHITECTURES


@pytest.mark.skipif(not LLAMA_SRC.exists(), reason="vendored llama.cpp source not unpacked")
def test_limits_match_llama_hparams() -> None:
    assert "#define LLAMA_MAX_EXPERTS 1024" in (LLAMA_SRC / "llama-hparams.h").read_text()
    assert "#define LLAMA_MAX_LAYERS  512" in (LLAMA_SRC / "llama-hparams.h").read_text()
