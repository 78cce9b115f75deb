"""Random-weight GGUF files with the exact shapes and hyperparameters of real MoE models.

For speed and memory benchmarks and for testing architectures without downloading
weights. The weights are random, so the router picks experts at random too: these
files say nothing about real routing locality or output quality.

Tensors are generated block by block directly in the target quant type
(`edgemoe.gguf.randquant`) and streamed to `OUT.tmp`, renamed to `OUT` at the end, so
memory stays bounded and an interrupted run leaves no half file.
"""

from __future__ import annotations

import logging
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, LlamaFileType, RopeScalingType, TokenType
from tqdm import tqdm

from .presets import (
    PRESETS,
    PlannedTensor,
    Role,
    SynthPreset,
    get_preset,
    n_layers_for,
    normalize_qtype,
    plan_tensors,
)
from .randquant import constant_f32, iter_random_tensor

__all__ = ["CHATML_TEMPLATE", "PRESETS", "plan_tensors", "synthetic_vocab", "write_synthetic"]

logger = logging.getLogger(__name__)

SYNTH_KEY_PRESET = "edgemoe.synthetic.preset"  # our own keys; llama.cpp ignores them
SYNTH_KEY_SEED = "edgemoe.synthetic.seed"
_PROGRESS_MIN_BYTES = 256 * 2**20

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few merges so the BPE path is exercised; "hello" becomes one token.
_MERGES = ("Ġ t", "h e", "i n", "e r", "Ġ a", "o n", "l l", "Ġt he", "he ll", "hell o")

_FILE_TYPES = {
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "F16": LlamaFileType.MOSTLY_F16,
    "F32": LlamaFileType.ALL_F32,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (openai/gpt-2 encoder.py)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def synthetic_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, merged tokens, specials, padding."""
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in _MERGES]
    types = [TokenType.NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is too small for the synthetic vocab ({len(tokens)} tokens)")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [TokenType.UNUSED] * (n_vocab - len(types))
    return tokens, [int(t) for t in types], list(_MERGES)


def _add_tokenizer(w: GGUFWriter, n_vocab: int) -> None:
    tokens, types, merges = synthetic_vocab(n_vocab)
    eot = tokens.index("<|endoftext|>")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_eot_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def _add_hparams(w: GGUFWriter, p: SynthPreset, n_layer: int) -> None:
    w.add_context_length(p.n_ctx_train)
    w.add_embedding_length(p.n_embd)
    w.add_block_count(n_layer + p.n_nextn)  # llama.cpp counts the MTP blocks among the blocks
    if p.n_nextn:
        w.add_nextn_predict_layers(p.n_nextn)
    w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_rope_freq_base(p.rope_freq_base)
    w.add_layer_norm_rms_eps(p.rms_eps)
    if p.is_moe:
        w.add_expert_count(p.n_expert)
        w.add_expert_used_count(p.n_expert_used)
    if p.n_ff_exp:
        w.add_expert_feed_forward_length(p.n_ff_exp)
    if p.arch == "llama":
        w.add_rope_dimension_count(p.head_dim)
        w.add_vocab_size(p.n_vocab)
    elif p.arch in ("qwen3moe", "gpt-oss"):
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
    if p.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)
    if p.arch == "gpt-oss":
        w.add_sliding_window(p.sliding_window)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    if p.mla is not None:
        _add_mla(w, p, n_layer)


def _add_mla(w: GGUFWriter, p: SynthPreset, n_layer: int) -> None:
    """DeepSeek-V2 keys as conversion/deepseek.py writes them (MLA as MQA with wide heads)."""
    mla = p.mla
    assert mla is not None
    w.add_leading_dense_block_count(min(p.n_layer_dense_lead, n_layer))
    w.add_vocab_size(p.n_vocab)
    # llama.cpp requires q_lora_rank unless n_layer is 26/27 ("lite"); 0 means plain wq.
    w.add_q_lora_rank(mla.q_lora_rank)
    w.add_kv_lora_rank(mla.kv_lora_rank)
    w.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
    w.add_value_length(mla.kv_lora_rank)
    w.add_key_length_mla(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    w.add_value_length_mla(mla.v_head_dim)
    w.add_rope_dimension_count(mla.qk_rope_head_dim)
    w.add_expert_shared_count(p.n_expert_shared)
    w.add_expert_weights_scale(1.0)
    if not p.tiny:  # V2-Lite's YaRN: factor 40 over 4096 tokens, mscale_all_dim 0.707
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(40.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)


def _tensor_bytes(t: PlannedTensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    if t.role is Role.NORM:
        yield constant_f32(t.n_elements, 1.0)
    elif t.role is Role.SCALE:
        yield rng.uniform(0.5, 1.5, t.n_elements).astype("<f4").view(np.uint8)
    else:
        yield from iter_random_tensor(t.qtype, t.n_elements, rng)


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # per tensor, so a tensor's values do not depend on --layers or on file order
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def write_synthetic(
    preset_name: str | SynthPreset,
    out_path: str | Path,
    *,
    layers: int | None = None,
    qtype: str = "Q4_K",
    seed: int = 0,
    progress: bool = True,
    expert_scales: bool = False,
    shape_only: bool = False,
) -> Path:
    """Write a random-weight GGUF of `preset_name` to `out_path` and return the path.

    `layers` keeps only the first N blocks of the trunk (MTP blocks follow, renumbered); `qtype` is the type of the large matrices
    (norms stay F32, the router F32, embeddings/output as llama-quantize's *_M mixes);
    `expert_scales` adds per-expert scales to the routed experts (plan_tensors).
    `shape_only` leaves every tensor's bytes as a hole of zeros (a sparse file that takes no disk space):
    for what reads only the header (`edgemoe simulate`), not for running.
    The same arguments always give byte-identical files.
    """
    preset = preset_name if isinstance(preset_name, SynthPreset) else get_preset(preset_name)
    q = normalize_qtype(qtype)
    n_layer = n_layers_for(preset, layers)
    plan = plan_tensors(preset, layers=n_layer, qtype=q, expert_scales=expert_scales)
    out = Path(out_path)
    tmp = out.with_name(out.name + ".tmp")

    w = GGUFWriter(tmp, preset.arch)
    w.add_name(f"edgemoe synthetic {preset.name}")
    w.add_file_type(int(_FILE_TYPES[q]))
    w.add_quantization_version(2)
    w.add_string(SYNTH_KEY_PRESET, preset.name)
    w.add_uint64(SYNTH_KEY_SEED, seed)
    _add_hparams(w, preset, n_layer)
    _add_tokenizer(w, preset.n_vocab)
    for t in plan:  # numpy order (reversed ne); the raw type carries the block layout
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)

    total = sum(t.nbytes for t in plan)
    logger.info(
        "writing %s (%s, %d layers, %s): %.2f GB of tensors", out, preset.name, n_layer, q, total / 1e9
    )
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        with _progress_bar(total, enabled=progress and total >= _PROGRESS_MIN_BYTES, desc=out.name) as bar:
            for t in plan:
                if shape_only:
                    fout.seek(t.nbytes, os.SEEK_CUR)
                    fout.truncate()
                    w.write_padding(fout, t.nbytes)
                    continue
                written = 0
                for chunk in _tensor_bytes(t, _tensor_rng(seed, t.name)):
                    fout.write(memoryview(chunk))  # pyright: ignore[reportArgumentType]  # numpy stubs: __buffer__ on 3.12+ only
                    written += chunk.nbytes
                    bar.update(chunk.nbytes)
                if written != t.nbytes:
                    raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
                w.write_padding(fout, t.nbytes)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _progress_bar(total: int, *, enabled: bool, desc: str) -> tqdm[Any]:

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )
