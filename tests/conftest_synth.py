"""Shared fixtures for the synthetic-model tests: tiny GGUFs written once per session.

Loaded with `pytest_plugins = ["conftest_synth"]` at the top of a test module.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from edgemoe.gguf.synth import write_synthetic
from edgemoe.gguf.presets import PRESETS

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

