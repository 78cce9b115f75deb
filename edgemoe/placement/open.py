"""open_engine: load a model with the expert cache a request asks for, as `edgemoe chat --vram ...` does."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..gguf.header import check_gguf
from ..gguf.info import model_info, parse_size
from ..gguf.kv_types import KvCacheType
from ..runtime.config import FlashAttn
from ..runtime.engine import Engine, LoadConfig
from .install import Notify, install_cache, install_gating, load_config
from .request import CacheRequest, cache_request

log = logging.getLogger(__name__)


def open_engine(
    model: str | Path,
    *,
    vram: int | str | None = None,
    expert_slots: int | None = None,
    policy: str | None = None,
    cache: CacheRequest | None = None,
    n_ctx: int = 0,
    n_threads: int = 0,
    n_gpu_layers: int = 0,
    flash_attn: FlashAttn = "auto",
    cache_type_k: KvCacheType = "f16",
    cache_type_v: KvCacheType = "f16",
    calibration: Path | None = None,
    gating: Any = None,
    notify: Notify = log.info,
) -> Engine:
    """An Engine of `model` with an expert cache of `vram` bytes (or a size such as "8GiB") or `expert_slots` per
    MoE layer, run by `policy` (None: the default for the other options); `cache` gives every option of the cache
    instead. With neither budget nor slots it loads as stock llama.cpp does. `flash_attn` ("auto": on where the
    backend supports it) and the KV cache's types (LoadConfig's) go to the engine, and a budget's plan reserves
    the KV cache of those types. `gating`
    (edgemoe.calibration.adaptive.GatingOptions) turns on adaptive top-k. Notes for the user go to `notify`.

        with edgemoe.open_engine("model.gguf", vram="8GiB") as engine:
            print(engine.generate("Hello", max_tokens=16).text)
    """
    path = Path(model)
    if cache is None:
        size = parse_size(vram, option="vram") if isinstance(vram, str) else vram
        cache = cache_request(vram=size, expert_slots=expert_slots, policy=policy)
    elif vram is not None or expert_slots is not None or policy is not None:
        raise TypeError("give the cache's options in `cache` or as vram/expert_slots/policy, not both")
    header = check_gguf(path)  # once: the load config and the engine (and its expert cache) share it
    base = LoadConfig(
        n_threads=n_threads,
        n_ctx=n_ctx,
        n_gpu_layers=n_gpu_layers,
        flash_attn=flash_attn,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
    )
    engine = Engine(path, load_config(base, cache, model_info(header)), header=header)
    if n_ctx and engine.n_ctx != n_ctx:
        notify(
            f"note: the context is {engine.n_ctx} tokens (llama.cpp sizes it in steps of 256; "
            f"a context of {n_ctx} was asked)"
        )
    if not engine.info.is_moe:
        notify(
            f"note: {path.name} is a dense model (no routed experts); edgemoe's MoE "
            "features are off and it runs as stock llama.cpp"
        )
    try:
        if engine.info.is_moe:
            install_cache(engine, path, cache, calibration, notify=notify)
        install_gating(engine, gating, notify=notify)
    except BaseException:
        engine.close()
        raise
    return engine
