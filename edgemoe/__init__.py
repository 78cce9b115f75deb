"""edgemoe: run GGUF Mixture-of-Experts LLMs on a CPU + consumer GPU, faster than stock llama.cpp.

Public API: open_engine (a model with an expert cache for a VRAM budget), CacheRequest, Engine, LoadConfig,
ChatSession, ChatMessage, SamplingParams, GREEDY.
Importing edgemoe does not load llama.cpp; the names below load it on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "runtime.engine",
    "LoadConfig": "runtime.engine",
    "ChatSession": "runtime.engine",
    "ChatMessage": "runtime.engine",
    "Generation": "runtime.engine",
    "SamplingParams": "runtime.sampling",
    "GREEDY": "runtime.sampling",
    "open_engine": "placement",
    "CacheRequest": "plan.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
