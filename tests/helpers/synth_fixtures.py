"""Shared fixtures for the synthetic-model tests: tiny GGUFs written once per session.

Registered in tests/conftest.py's `pytest_plugins`: a test takes make_tiny_gguf, tiny_gguf or arctic_like_gguf by
name.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from edgemoe.gguf.presets import PRESETS
from edgemoe.gguf.synth import write_synthetic

TINY_PRESETS: tuple[str, ...] = tuple(name for name, p in PRESETS.items() if p.tiny)
MakeGguf = Callable[..., Path]


@pytest.fixture(scope="session")
def make_tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> MakeGguf:
    """make(preset, qtype="Q4_K", seed=0, layers=None) -> path; each file is written once."""
    root = tmp_path_factory.mktemp("synth")
    cache: dict[tuple[str, str, int, int | None], Path] = {}

    def make(preset: str, qtype: str = "Q4_K", seed: int = 0, layers: int | None = None) -> Path:
        assert PRESETS[preset].tiny, "tests write tiny presets only; plan_tensors() covers the big ones"
        key = (preset, qtype, seed, layers)
        if key not in cache:
            out = root / f"{preset}-{qtype}-s{seed}-l{layers}.gguf"
            cache[key] = write_synthetic(preset, out, qtype=qtype, seed=seed, layers=layers, progress=False)
        return cache[key]

    return make


@pytest.fixture(params=TINY_PRESETS)
def tiny_gguf(request: pytest.FixtureRequest, make_tiny_gguf: MakeGguf) -> Path:
    """Each tiny preset at Q4_K, seed 0."""
    return make_tiny_gguf(request.param)



@pytest.fixture(scope="session")
def arctic_like_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One arctic layer's MoE tensors, F32: 2 stacked experts (element value = 10*expert + index) beside
    the MoE branch's norm blk.0.ffn_norm_exps.weight ([n_embd], not per expert) and the router."""
    n_embd, n_ff, n_expert = 4, 3, 2
    path = tmp_path_factory.mktemp("arctic") / "arctic-like.gguf"
    w = GGUFWriter(path, "arctic")
    w.add_block_count(1)
    w.add_embedding_length(n_embd)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)

    def stacked(*shape: int) -> np.ndarray:  # numpy order: (n_expert, rows, cols)
        per = np.arange(np.prod(shape[1:]), dtype=np.float32).reshape(shape[1:])
        return np.stack([per + 10 * e for e in range(shape[0])])

    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((n_expert, n_embd), np.float32))
    w.add_tensor("blk.0.ffn_norm_exps.weight", np.arange(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", stacked(n_expert, n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down_exps.weight", stacked(n_expert, n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
