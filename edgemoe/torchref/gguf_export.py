"""Write a torch reference model (edgemoe.torchref.model) as a GGUF llama.cpp loads.

Weights go out as F32 (exact); quantize afterwards with llama.cpp's own
quantizer (``llama_model_quantize``). Metadata keys come from gguf.constants.Keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from .model import MoEConfig, MoEModel

K = gguf.Keys


@dataclass(frozen=True)
class VocabSpec:
    """A byte-level BPE vocabulary (GPT-2 style) with its special tokens."""

    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    merges: list[str]
    bos_id: int
    eos_id: int
    add_bos: bool
    chat_template: str
    pre: str = "gpt-2"
    extra: dict[str, int] = field(default_factory=dict)  # e.g. {"eot": id}


def write_metadata(w: gguf.GGUFWriter, cfg: MoEConfig, vocab: VocabSpec, name: str) -> None:
    arch = cfg.arch
    w.add_name(name)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
        w.add_feed_forward_length(cfg.n_ff_exp * cfg.n_expert_used)
    else:  # llama with experts: feed_forward_length is the expert width
        w.add_feed_forward_length(cfg.n_ff_exp)
        w.add_vocab_size(cfg.n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(False)
    w.add_chat_template(vocab.chat_template)


def tensor_map(model: MoEModel) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) in llama.cpp's naming; numpy shapes are GGUF shapes reversed."""
    cfg = model.cfg
    out = [("token_embd.weight", model.tok_embd.weight)]
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", b.attn_norm.weight),
            (p + "attn_q.weight", b.attn.wq.weight),
            (p + "attn_k.weight", b.attn.wk.weight),
            (p + "attn_v.weight", b.attn.wv.weight),
            (p + "attn_output.weight", b.attn.wo.weight),
        ]
        if cfg.qk_norm:
            out += [
                (p + "attn_q_norm.weight", b.attn.q_norm.weight),
                (p + "attn_k_norm.weight", b.attn.k_norm.weight),
            ]
        out += [
            (p + "ffn_norm.weight", b.ffn_norm.weight),
            (p + "ffn_gate_inp.weight", b.moe.router.weight),  # (E, D)
            (p + "ffn_gate_exps.weight", b.moe.gate),  # (E, n_ff, D)
            (p + "ffn_up_exps.weight", b.moe.up),
            (p + "ffn_down_exps.weight", b.moe.down),  # (E, D, n_ff)
        ]
    out += [("output_norm.weight", model.out_norm.weight), ("output.weight", model.output.weight)]
    return out


def export_gguf(model: MoEModel, vocab: VocabSpec, path: Path, name: str) -> Path:
    """Write the model as an F32 GGUF at ``path`` (via a temp file, renamed when complete)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    w = gguf.GGUFWriter(str(tmp), model.cfg.arch)
    write_metadata(w, model.cfg, vocab, name)
    for tname, t in tensor_map(model):
        w.add_tensor(tname, t.detach().to(torch.float32).contiguous().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path
