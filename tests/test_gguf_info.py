"""Model inspection, VRAM planning, size parsing and GGUF validation (no llama.cpp)."""
from __future__ import annotations

import dataclasses
import json
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import Keys

from edgemoe.errors import InvalidSizeError, ModelLoadError, UnsupportedArchitectureError
from edgemoe.gguf.info import (
    KNOWN_ARCHITECTURES,
    check_gguf,
    info_to_dict,
    parse_size,
    read_model_info,
)
from edgemoe.gguf.presets import PRESETS
from edgemoe.plan.budget import estimate_kv_cache_bytes, slot_budget

MakeGguf = Callable[..., Path]  # the make_tiny_gguf fixture

# unpacked by tools/build_llama.py (make install) on every machine that built the library
VENDORED_ARCH_CPP = (Path(__file__).resolve().parents[1] / ".build/src/llama_cpp_python-0.3.36"
                     / "vendor/llama.cpp/src/llama-arch.cpp")


# --------------------------------------------------------------------------- read_model_info


def test_info_matches_gguf_reader(tiny_gguf: Path) -> None:
    info = read_model_info(tiny_gguf)
    reader = GGUFReader(tiny_gguf)
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors}

    assert info.total_tensor_bytes == sum(nbytes.values())
    trunk = info.n_layer - info.n_nextn  # MTP blocks (blk.{trunk}..) count as mtp_bytes only
    mtp = {name for name in nbytes if name.startswith(tuple(f"blk.{il}." for il in range(trunk, info.n_layer)))}
    assert info.mtp_bytes == sum(nbytes[name] for name in mtp)
    assert info.expert_bytes_total == sum(n for name, n in nbytes.items() if "_exps" in name and name not in mtp)
    assert info.shared_expert_bytes == sum(n for name, n in nbytes.items() if "_shexp" in name and name not in mtp)
    assert info.expert_bytes_total + info.dense_bytes + info.mtp_bytes == info.total_tensor_bytes
    assert sum(info.bytes_by_type.values()) == info.total_tensor_bytes
    for qtype, total in info.bytes_by_type.items():
        assert total == sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name == qtype)
    assert info.file_size == tiny_gguf.stat().st_size
    assert info.n_vocab == len(reader.fields[Keys.Tokenizer.LIST].data)

    preset = PRESETS[str(reader.fields["edgemoe.synthetic.preset"].contents())]
    assert info.architecture == preset.arch
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == (
        preset.n_layer + preset.n_nextn, preset.n_embd, preset.n_head, preset.n_head_kv)
    assert (info.n_nextn, info.mtp_heads) == (preset.n_nextn, preset.n_nextn > 0)
    assert (info.n_expert, info.n_expert_used) == (preset.n_expert, preset.n_expert_used)
    assert info.is_moe == preset.is_moe
    assert info.moe_layers == (tuple(range(preset.n_layer_dense_lead, preset.n_layer)) if preset.is_moe else ())
    if preset.is_moe:
        assert info.n_ff_exp == (preset.n_ff_exp or preset.n_ff)
        assert set(info.bytes_per_expert_by_layer) == set(info.moe_layers)
        assert info.bytes_per_expert * info.n_expert * len(info.moe_layers) == info.expert_bytes_total
        for layer, tensors in info.expert_tensors.items():
            assert all(t.shape[-1] == info.n_expert and t.nbytes == t.bytes_per_expert * info.n_expert
                       for t in tensors)
            assert sum(t.bytes_per_expert for t in tensors) == info.bytes_per_expert_by_layer[layer]
    else:
        assert info.expert_bytes_total == info.bytes_per_expert == info.n_ff_exp == 0


def test_info_shared_experts_and_mla(make_tiny_gguf: MakeGguf) -> None:
    ds = read_model_info(make_tiny_gguf("tiny-deepseek2"))
    assert ds.moe_layers == (1, 2)  # one leading dense layer
    assert ds.n_expert_shared == 2 and ds.shared_expert_bytes > 0
    assert (ds.kv_lora_rank, ds.n_rot) == (128, 32)
    qwen2 = read_model_info(make_tiny_gguf("tiny-qwen2moe"))
    assert qwen2.n_expert_shared == 1 and qwen2.shared_expert_bytes > 0
    assert read_model_info(make_tiny_gguf("tiny-gpt-oss")).sliding_window == 128


def test_info_per_expert_bytes_by_type(make_tiny_gguf: MakeGguf) -> None:
    info = read_model_info(make_tiny_gguf("tiny-qwen3moe", qtype="Q8_0"))
    gate = next(t for t in info.expert_tensors[0] if t.name == "blk.0.ffn_gate_exps.weight")
    assert gate.qtype == "Q8_0" and gate.shape == (256, 256, 8)
    assert gate.bytes_per_expert == 256 * 256 // 32 * 34
    assert info.bytes_per_expert == 3 * gate.bytes_per_expert


def test_info_to_dict_is_json(make_tiny_gguf: MakeGguf) -> None:
    d = json.loads(json.dumps(info_to_dict(read_model_info(make_tiny_gguf("tiny-deepseek2")))))
    for key in ("architecture", "n_layer", "n_expert", "n_expert_used", "expert_bytes_total", "dense_bytes",
                "n_expert_shared", "n_ff_exp", "moe_layers", "expert_tensors", "bytes_per_expert",
                "bytes_per_expert_by_layer", "shared_expert_bytes", "total_tensor_bytes", "bytes_by_type",
                "is_moe", "file_size", "n_ctx_train", "n_vocab", "n_head", "n_head_kv", "n_embd"):
        assert key in d, key
    assert d["moe_layers"] == [1, 2] and d["architecture"] == "deepseek2"
    assert d["expert_tensors"]["1"][0]["shape"][-1] == 8


def test_info_counts_only_stacked_experts(arctic_like_gguf: Path) -> None:
    """arctic's blk.N.ffn_norm_exps.weight is the MoE branch's norm ([n_embd]), not an expert tensor."""
    info = read_model_info(arctic_like_gguf)
    names = [t.name for t in info.expert_tensors[0]]
    assert names == ["blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"]
    assert info.bytes_per_expert == 2 * 3 * 4 * 4  # up and down: 3x4 F32 each
    assert info.expert_bytes_total == 2 * info.bytes_per_expert
    assert info.dense_bytes == (2 * 4 + 4) * 4  # the router and the norm
    assert info.n_ff_exp == 3


def test_read_model_info_is_header_only(tmp_path: Path) -> None:
    # 8 GiB of (sparse) tensor data: reading any of it would take far longer than the limit
    path = tmp_path / "sparse.gguf"
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_expert_count(64)
    shape, n_bytes = (2048, 4096, 64), 2048 * 4096 * 64 // 256 * 144
    w.add_tensor_info("blk.0.ffn_up_exps.weight", tuple(reversed(shape)), np.dtype(np.float32), n_bytes,
                      raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    w.write_padding(w.fout[0], w.fout[0].tell())
    w.fout[0].truncate(w.fout[0].tell() + n_bytes)
    w.close()
    start = time.perf_counter()
    info = read_model_info(path)
    assert time.perf_counter() - start < 1.0
    assert info.expert_bytes_total == n_bytes and info.bytes_per_expert == n_bytes // 64


# --------------------------------------------------------------------------- slot_budget (edgemoe.plan.budget)


def test_slot_budget_counts_expert_slots(make_tiny_gguf: MakeGguf) -> None:
    info = read_model_info(make_tiny_gguf("tiny-qwen3moe"))
    kv = estimate_kv_cache_bytes(info, 128)
    assert kv == info.n_layer * 128 * info.n_head_kv * (64 + 64) * 2
    slot = info.bytes_per_expert * len(info.moe_layers)

    plan = slot_budget(info, info.dense_bytes + kv + 3 * slot + slot // 2, n_ctx=128)
    assert plan.dense_fits and plan.experts_per_layer == 3 and plan.slot_bytes == slot
    assert plan.expert_fraction == pytest.approx(3 / 8) and not plan.all_experts_fit

    everything = slot_budget(info, 10**12, n_ctx=128)
    assert everything.experts_per_layer == info.n_expert and everything.all_experts_fit

    too_small = slot_budget(info, info.dense_bytes // 2, n_ctx=128)
    assert not too_small.dense_fits and too_small.experts_per_layer == 0 and too_small.expert_fraction == 0

    reserved = slot_budget(info, info.dense_bytes + kv + 3 * slot, n_ctx=128, reserve_bytes=slot)
    assert reserved.experts_per_layer == 2


def test_slot_budget_mla_cache_and_dense_models(make_tiny_gguf: MakeGguf) -> None:
    ds = read_model_info(make_tiny_gguf("tiny-deepseek2"))
    assert estimate_kv_cache_bytes(ds, 1000) == 3 * 1000 * (128 + 32) * 2  # latent + rope, no V
    dense = read_model_info(make_tiny_gguf("tiny-llama-dense"))
    plan = slot_budget(dense, dense.dense_bytes + estimate_kv_cache_bytes(dense, 64), n_ctx=64)
    assert plan.dense_fits and plan.n_moe_layers == 0 and plan.expert_fraction == 1.0
    assert not slot_budget(dense, 1000, n_ctx=64).dense_fits
    with pytest.raises(ValueError):
        slot_budget(dense, 1000, n_ctx=0)


def test_slot_budget_real_qwen3_shapes_without_writing(make_tiny_gguf: MakeGguf) -> None:
    # numbers of the full model from the plan, checked against the published sizes
    from edgemoe.gguf.presets import Role, plan_tensors

    plan = plan_tensors("qwen3-30b-a3b")
    experts = sum(t.nbytes for t in plan if t.role is Role.EXPERT)
    assert 16.0e9 < experts < 16.5e9  # 29.0e9 expert weights at 4.5 bits
    info = dataclasses.replace(
        read_model_info(make_tiny_gguf("tiny-qwen3moe")), n_layer=48, n_head_kv=4, n_embd_head_k=128,
        n_embd_head_v=128, n_expert=128, moe_layers=tuple(range(48)), dense_bytes=sum(t.nbytes for t in plan) - experts,
        bytes_per_expert_by_layer={i: experts // 48 // 128 for i in range(48)})
    plan6 = slot_budget(info, parse_size("6GiB"), n_ctx=4096)
    assert plan6.kv_cache_bytes == 48 * 4096 * 4 * 256 * 2  # 384 MiB
    assert plan6.dense_fits and 30 < plan6.experts_per_layer < 50


# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("6GiB", 6 * 2**30), ("6gib", 6 * 2**30), ("8GB", 8 * 10**9), ("8 gb", 8 * 10**9),
    ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("1.5 TB", 15 * 10**11),
    ("2KiB", 2048), ("2kb", 2000), ("1TiB", 2**40), ("4096", 4096), ("4096B", 4096), (" 7 ", 7),
    ("0", 0), ("6G", 6 * 2**30), ("512m", 512 * 2**20), (".5GiB", 2**29), (1234, 1234),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["6 gigs", "", "GiB", "-1GiB", "1.5", "six", "1e9", "6GiBs", "1.2.3GB", "0x10"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(InvalidSizeError, match=re.escape(f"cannot parse --vram {text!r}: use a size such as 6GiB")):
        parse_size(text, option="--vram")


def test_parse_size_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot parse size '6 gigs': use a size such as 6GiB, 8GB or 512MiB"):
        parse_size("6 gigs")


# --------------------------------------------------------------------------- check_gguf


def test_check_accepts_every_tiny_preset(tiny_gguf: Path) -> None:
    header = check_gguf(tiny_gguf)
    assert header.data_end == tiny_gguf.stat().st_size
    assert header.architecture in KNOWN_ARCHITECTURES


def test_check_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model file not found: .*nope\.gguf \(check the path"):
        check_gguf(tmp_path / "nope.gguf")


def test_check_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory, not a GGUF file: pass the path of the .gguf file"):
        check_gguf(tmp_path)


@pytest.mark.parametrize(("content", "message"), [
    (b"hello, I am a text file\n", r"is not a GGUF file \(it starts with b'hell', not b'GGUF'\)"),
    (b"", r"is not a GGUF file"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n", r"is a Git LFS pointer.*git lfs pull"),
    (b"<!DOCTYPE html><html>Not found</html>", r"looks like an HTML/XML page"),
])
def test_check_not_gguf(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message) as err:
        check_gguf(path)
    assert not isinstance(err.value, UnsupportedArchitectureError)
    assert "\n" not in str(err.value)


def _copy(src: Path, dst: Path, data: bytes | None = None, cut: int | None = None) -> Path:
    raw = src.read_bytes() if data is None else data
    dst.write_bytes(raw if cut is None else raw[:cut])
    return dst


def test_check_truncated_in_header(make_tiny_gguf: MakeGguf, tmp_path: Path) -> None:
    src = make_tiny_gguf("tiny-qwen3moe")
    for cut in (10, 1000, check_gguf(src).data_offset - 100):
        path = _copy(src, tmp_path / f"cut{cut}.gguf", cut=cut)
        with pytest.raises(ModelLoadError, match=rf"is truncated or corrupt: its header needs byte \d+ but the "
                                                 rf"file has only {cut} bytes; download it again"):
            check_gguf(path)


def test_check_truncated_in_tensor_data(make_tiny_gguf: MakeGguf, tmp_path: Path) -> None:
    src = make_tiny_gguf("tiny-qwen3moe")
    size = src.stat().st_size
    path = _copy(src, tmp_path / "short.gguf", cut=size - 1000)
    with pytest.raises(ModelLoadError, match=rf"is truncated: tensor 'blk\.1\.ffn_down_exps\.weight' ends at byte "
                                             rf"{size} but the file has only {size - 1000} bytes \(1000 missing\)"):
        check_gguf(path)
    with pytest.raises(ModelLoadError, match="is truncated"):
        read_model_info(path)


def _patch_arch(raw: bytes, new: bytes) -> bytes:
    key = Keys.General.ARCHITECTURE.encode()
    at = raw.index(key) + len(key) + 4  # key, then u32 value type
    (n,) = struct.unpack_from("<Q", raw, at)
    return raw[:at] + struct.pack("<Q", len(new)) + new + raw[at + 8 + n:]


def test_check_unknown_architecture(make_tiny_gguf: MakeGguf, tmp_path: Path) -> None:
    src = make_tiny_gguf("tiny-qwen3moe")
    # same length keeps the data section aligned
    path = _copy(src, tmp_path / "alien.gguf", data=_patch_arch(src.read_bytes(), b"alien9ax"))
    with pytest.raises(UnsupportedArchitectureError, match="architecture 'alien9ax' is not supported by llama.cpp"):
        check_gguf(path)
    assert "clip" not in KNOWN_ARCHITECTURES and "gpt-oss" in KNOWN_ARCHITECTURES


def test_check_corrupt_metadata(make_tiny_gguf: MakeGguf, tmp_path: Path) -> None:
    raw = make_tiny_gguf("tiny-qwen3moe").read_bytes()
    key = Keys.LLM.CONTEXT_LENGTH.format(arch="qwen3moe").encode()
    at = raw.index(key) + len(key)
    bad_type = raw[:at] + struct.pack("<I", 99) + raw[at + 4:]
    with pytest.raises(ModelLoadError, match="has corrupt metadata: key 'qwen3moe.context_length' has unknown "
                                             "value type 99; download it again"):
        check_gguf(_copy(Path(), tmp_path / "badtype.gguf", data=bad_type))
    bad_version = raw[:4] + struct.pack("<I", 7) + raw[8:]
    with pytest.raises(ModelLoadError, match="GGUF version 7 is not supported"):
        check_gguf(_copy(Path(), tmp_path / "badversion.gguf", data=bad_version))
    huge_count = raw[:8] + struct.pack("<Q", 2**40) + raw[16:]
    with pytest.raises(ModelLoadError, match=r"claims \d+ keys and 1099511627776 tensors"):
        check_gguf(_copy(Path(), tmp_path / "huge.gguf", data=huge_count))
    no_arch = raw.replace(Keys.General.ARCHITECTURE.encode(), b"general.architecturX", 1)
    with pytest.raises(ModelLoadError, match="there is no string key 'general.architecture'"):
        check_gguf(_copy(Path(), tmp_path / "noarch.gguf", data=no_arch))


@pytest.mark.skipif(not VENDORED_ARCH_CPP.exists(), reason="vendored llama.cpp source not unpacked")
def test_known_architectures_match_vendored_llama_arch_cpp() -> None:
    src = VENDORED_ARCH_CPP.read_text()
    table = src[src.index("LLM_ARCH_NAMES = {"):]
    names = re.findall(r'\{\s*LLM_ARCH_\w+,\s*"([^"]+)"\s*\}', table[:table.index("};")])
    assert tuple(n for n in names if n not in ("clip", "(unknown)")) == KNOWN_ARCHITECTURES


def test_vram_reserve_grows_with_the_context_past_4096_tokens(tmp_path: Path) -> None:
    """Without flash attention llama.cpp's compute buffer holds one ubatch's attention scores: the plan
    reserves them past 4096 tokens, and plan's budget for N slots, stock's --n-cpu-moe and the slots agree."""
    from edgemoe.gguf.synth import write_synthetic
    from edgemoe.plan.budget import best_n_cpu_moe, slot_budget
    from edgemoe.plan.reserve import (
        RESERVE_CTX,
        VRAM_RESERVE,
        budget_for_slots,
        context_reserve_bytes,
        reserve_bytes,
    )

    info = read_model_info(write_synthetic("qwen3-30b-a3b", tmp_path / "q.gguf", layers=2, shape_only=True,
                                           progress=False))
    assert context_reserve_bytes(info, RESERVE_CTX) == 0 == context_reserve_bytes(info, 512)
    assert reserve_bytes(info, 4096) == VRAM_RESERVE
    assert slot_budget(info, 8 * 2**30, n_ctx=4096, reserve_bytes=reserve_bytes(info, 4096)).reserve_bytes == VRAM_RESERVE
    long = slot_budget(info, 8 * 2**30, n_ctx=16384, reserve_bytes=reserve_bytes(info, 16384))
    assert long.reserve_bytes == VRAM_RESERVE + (16384 - 4096) * 512 * info.n_head * 4
    assert slot_budget(info, 8 * 2**30, n_ctx=16384).reserve_bytes == 0  # no reserve asked: none added
    for n_ctx in (4096, 16384):
        vram = budget_for_slots(info, 8, n_ctx)
        reserve = reserve_bytes(info, n_ctx)
        assert slot_budget(info, vram, n_ctx=n_ctx, reserve_bytes=reserve).experts_per_layer == 8
        assert slot_budget(info, vram - 1, n_ctx=n_ctx, reserve_bytes=reserve).experts_per_layer == 7
    whole = budget_for_slots(info, info.n_expert, 16384)
    stock = reserve_bytes(info, 16384)
    assert best_n_cpu_moe(info, whole, 16384, reserve_bytes=stock) == 0
    assert best_n_cpu_moe(info, whole - 1, 16384, reserve_bytes=stock) == 1
