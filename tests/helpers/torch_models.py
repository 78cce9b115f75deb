"""Random models of the torch reference (edgemoe.torchref) and their GGUF exports."""
from __future__ import annotations

from pathlib import Path

import torch

from edgemoe.gguf.synth import synthetic_vocab
from edgemoe.torchref.gguf_export import VocabSpec, export_gguf
from edgemoe.torchref.model import MoEConfig, MoEModel


def _vocab(n_vocab: int) -> VocabSpec:
    tokens, types, merges = synthetic_vocab(n_vocab)
    eot = tokens.index("<|endoftext|>")
    return VocabSpec(tokens=tokens, token_types=types, merges=merges, bos_id=eot, eos_id=eot,
                     add_bos=False, chat_template="")


def random_exported_model(tmp_path: Path, cfg: MoEConfig, seed: int) -> tuple[MoEModel, Path]:
    """A random torch reference model (weights larger than the init, so routing and attention
    matter) and its F32 GGUF export."""
    torch.manual_seed(seed)
    model = MoEModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, export_gguf(model, _vocab(cfg.n_vocab), tmp_path / f"{cfg.arch}.gguf", "test")
