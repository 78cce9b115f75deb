"""open_engine: load a model with the expert cache a request asks for, as `edgemoe chat --vram ...` does."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..gguf.header import check_gguf
from ..gguf.info import parse_size
from ..plan.planner import Device, plan
from ..plan.request import CacheRequest, cache_request
from ..plan.ubatch import PrefillPricing
from ..runtime import native
from ..runtime.config import LoadOptions
from ..runtime.engine import Engine
from ..speculation.config import SpeculationConfig
from .install import Notify, install_cache, install_gating

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

log = logging.getLogger(__name__)


def open_engine(
    model: str | Path,
    *,
    vram: int | str | None = None,
    expert_slots: int | None = None,
    policy: str | None = None,
    cache: CacheRequest | None = None,
    n_ctx: int = 0,
    calibration: Path | None = None,
    gating: Any = None,
    speculation: SpeculationConfig | None = None,
    notify: Notify = log.info,
    **load: Unpack[LoadOptions],
) -> Engine:
    """An Engine of `model` with an expert cache of `vram` bytes (or a size such as "8GiB") or `expert_slots` per
    MoE layer, run by `policy` (None: the default for the other options); `cache` gives every option of the cache
    instead. With neither budget nor slots it loads as stock llama.cpp does. `n_ctx` 0: with a budget, the context
    the plan picks for it (edgemoe.plan.context.default_context, said in a note); else the model's, at most
    4096; a context given is never changed. `load`: LoadConfig's n_threads, n_gpu_layers, flash_attn ("auto": on
    where the backend supports it), the KV cache's types (cache_type_k, cache_type_v) and n_batch / n_ubatch
    (llama.cpp's -b / -ub), which go to the engine; a budget's plan reserves the KV cache of those types. With a
    budget on a GPU (or with the cache request's machine `profile` named), the plan picks the prefill ubatch
    for a long prompt (edgemoe.plan.ubatch, said in a note) unless n_ubatch is given; else it is 512. `gating`
    (edgemoe.calibration.adaptive.GatingOptions) turns on adaptive top-k; `speculation` speculative decoding
    (Engine.set_speculation: a draft model is opened then; `mtp` loads the model's MTP heads). Notes for the user go to `notify`.
    The placement is planned once from the file's header (edgemoe.plan.plan), before the model loads; a
    policy whose calibration the model lacks is calibrated on this engine before its cache is installed.

        with edgemoe.open_engine("model.gguf", vram="8GiB") as engine:
            print(engine.generate("Hello", max_tokens=16).text)
    """
    path = Path(model)
    if cache is None:
        size = parse_size(vram, option="vram") if isinstance(vram, str) else vram
        cache = cache_request(vram=size, expert_slots=expert_slots, policy=policy)
    elif vram is not None or expert_slots is not None or policy is not None:
        raise TypeError("give the cache's options in `cache` or as `vram`/`expert_slots`/`policy`, not both")
    header = check_gguf(path)  # once: the plan and the engine (and its expert cache) share it
    device = this_device()
    if device is not None and cache.vram is not None:  # the budget's compute buffers measured, not estimated
        device = replace(device, compute=measured_compute(path, header, load))
    if speculation is not None and speculation.mode == "mtp":
        # the MTP blocks load only for drafting with them; the plan reserves them
        load = {**load, "load_mtp": True}
    pricing = prefill_pricing(cache.profile) if cache.vram is not None and (device or cache.profile) else None
    placement = plan(
        header, cache, n_ctx=n_ctx, device=device, profile=pricing, calibration=calibration, **load
    )
    engine = Engine(path, placement.load, header=header)
    for note in placement.notes:
        notify(note)
    try:
        install_cache(engine, cache, placement, notify=notify)
        install_gating(engine, gating, notify=notify)
        engine.set_speculation(speculation)
    except BaseException:
        engine.close()
        raise
    return engine


def this_device() -> Device | None:
    """The GPU of this build as a plan's Device (None in a CPU-only build)."""
    dev = native.gpu_device()
    if dev is None:
        return None
    free, _total = native.device_memory(dev)
    return Device(name=native.device_name(dev), free_bytes=free)


def measured_compute(path: Path, header: Any, load: LoadOptions) -> Any:
    """The compute buffers of `path` on this build's device as a plan with a budget loads it (every layer on the
    device, the routed experts in CPU memory), measured by no_alloc loads (edgemoe.perf.measure.compute_buffers)."""
    from ..gguf.info import model_info
    from ..perf.measure.compute_buffers import MeasuredCompute
    from ..runtime.config import LoadConfig

    moe = tuple(model_info(header).moe_layers)
    return MeasuredCompute(path, LoadConfig(**{**load, "n_gpu_layers": 999, "cpu_expert_layers": moe}))


def prefill_pricing(name: str | None) -> PrefillPricing | None:
    """What prices device prefill for the plan's ubatch: the machine profile named (a bundled name or a file),
    else this machine's measured one (what `edgemoe plan` uses); None where there is none or it has no GPU (the
    prefill plan prices GPU prefill)."""
    from ..perf.measure.profiling import default_profile_path
    from ..perf.model.prefill_plan import ProfilePricing
    from ..perf.model.profile import load_profile

    if name is None:
        if not default_profile_path().exists():
            return None
        name = str(default_profile_path())
    prof = load_profile(name)
    return ProfilePricing(prof) if prof.has_gpu else None
