"""llama.cpp's compute buffers measured, not estimated: the model loaded with `no_alloc` (its tensors' metadata
only, no weight read) and a context created for it, whose graph reservation sizes every backend's compute buffer
without allocating it, as llama.cpp's common/fit does (common_get_device_memory_data). The sizes come from the
context's log ("compute buffer size"), the one place the C API gives them; 0.01 MiB resolution.

A measurement per (context, ubatch, flash attention) is one such load: a fraction of a second on the fixtures,
about a second on a 30B model (its header read again). edgemoe.plan.reserve.compute_buffer_bytes is the formula it
checks (docs/research/performance-model.md, "Compute buffers, measured").
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import ModelLoadError
from ...gguf.header import check_gguf
from ...gguf.info import model_info
from ...runtime import native
from ...runtime.config import LoadConfig
from ...runtime.handle import buft_overrides, context_params
from ...runtime.native import lib

_SIZE = re.compile(r"(\S+) compute buffer size = +([\d.]+) MiB")
MIB = 2**20


@dataclass(frozen=True)
class ComputeBuffers:
    """The compute buffer of each backend buffer type (its name, e.g. "CPU", "RPC0[127.0.0.1:5000]") of one
    context, in bytes."""

    n_ctx: int
    n_ubatch: int
    flash_attn: str
    by_buffer: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_buffer.values())

    def device_bytes(self) -> int:
        """The bytes on the buffers that are not the host's (a GPU's, the RPC device's)."""
        return sum(n for name, n in self.by_buffer.items() if not name.startswith("CPU"))


def measure_compute_buffers(path: str | os.PathLike[str], config: LoadConfig) -> ComputeBuffers:
    """The compute buffers llama.cpp reserves for a context of `config` (its n_ctx, n_ubatch, flash attention, KV
    types, GPU layers and CPU expert layers) over the model at `path`, with no weight loaded or buffer allocated.
    Raises ModelLoadError where llama.cpp cannot create the context."""
    path = Path(path)
    info = model_info(check_gguf(path))
    lib.llama_backend_init()
    native.route_logs_to_python()  # the sizes are read from the log
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = config.n_gpu_layers
    mparams.load_mode = lib.LLAMA_LOAD_MODE_NONE
    mparams.no_alloc = True
    mparams.use_extra_bufts = config.use_extra_bufts
    mparams.load_mtp = config.load_mtp
    overrides = buft_overrides(config, info)  # kept alive while llama.cpp reads it
    if overrides is not None:
        mparams.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)  # pyright: ignore[reportAttributeAccessIssue]  # a pointer field the stub types as an array
    model = lib.llama_model_load_from_file(os.fsencode(path), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not read {path} (no_alloc)")
    try:
        n_ctx = config.n_ctx or min(info.n_ctx_train, 4096)
        cparams = context_params(config, n_ctx, config.n_threads or 1)
        with native.captured_log() as logged:
            ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not reserve a context of {n_ctx} tokens for {path}")
        lib.llama_free(ctx)
    finally:
        lib.llama_model_free(model)
    sizes = {m.group(1): round(float(m.group(2)) * MIB) for line in logged if (m := _SIZE.search(line))}
    return ComputeBuffers(n_ctx, cparams.n_ubatch, config.flash_attn, sizes)


class MeasuredCompute:
    """A device's compute buffer for one model and load config, measured once per (context, ubatch, flash attention)
    (edgemoe.plan.reserve.ComputeMeasure: what open_engine hands the plan with a GPU or the RPC device)."""

    def __init__(self, path: str | os.PathLike[str], config: LoadConfig, *, device_only: bool = True) -> None:
        self.path, self.config = Path(path), config
        self.device_only = (
            device_only  # the device's buffers (a budget's); False: every buffer, the host's too
        )
        self._memo: dict[tuple[int, int, bool], int] = {}

    def __call__(self, n_ctx: int, n_ubatch: int, flash_attn: bool) -> int:
        key = (n_ctx, n_ubatch, flash_attn)
        if key not in self._memo:
            on = "on" if self.config.flash_attn == "on" else "auto"  # a plan's True: not "off"
            asked = replace(
                self.config, n_ctx=n_ctx, n_batch=max(n_ubatch, self.config.n_batch), n_ubatch=n_ubatch,
                flash_attn=on if flash_attn else "off",
            )  # fmt: skip
            measured = measure_compute_buffers(self.path, asked)
            self._memo[key] = measured.device_bytes() if self.device_only else measured.total
        return self._memo[key]


def measure_grid(
    path: str | os.PathLike[str], config: LoadConfig, contexts: tuple[int, ...], ubatches: tuple[int, ...]
) -> list[ComputeBuffers]:
    """measure_compute_buffers at every context x ubatch (each ubatch at most its context)."""
    return [
        measure_compute_buffers(path, replace(config, n_ctx=c, n_batch=max(u, config.n_batch), n_ubatch=u))
        for c in contexts
        for u in ubatches
        if u <= c
    ]
