"""The llama.cpp objects of one Engine: the model, its vocabulary and one context, loaded from a LoadConfig.

NativeHandle owns the pointers (and the override arrays llama.cpp reads while loading) and frees them in
free(); every component of the Engine reads them through it, so any use after close raises EngineClosedError.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ..errors import EngineClosedError, ModelLoadError
from ..gguf.info import ModelInfo
from ..gguf.kv_types import ggml_type
from . import device_ids, native
from .config import FlashAttn, LoadConfig, default_threads
from .native import lib

_GRAPH_LINE = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = (\d+)(?: / (\d+))?")


def graph_nodes_logged(lines: list[str]) -> tuple[int, int] | None:
    """(prefill, decode) node counts of the graphs llama.cpp reserved for a new context, from its log."""
    for line in reversed(lines):
        m = _GRAPH_LINE.search(line)
        if m:
            return int(m.group(1)), int(m.group(2) or m.group(1))
    return None


_KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB .*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)
_FLASH_ATTN_PROBE = re.compile(r"Flash Attention (enabled|not supported)")
_FLASH_ATTN_TYPE: dict[FlashAttn, int] = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass(frozen=True)
class KvCacheInfo:
    """A context's KV cache as llama.cpp logged it when it made it (its caches together: two with sliding windows)."""

    type_k: str  # ggml's name of the K cache's type, e.g. "q8_0"
    type_v: str
    k_mib: float  # the K cache's size (MiB, to 2 decimals as logged)
    v_mib: float


def kv_cache_logged(lines: list[str]) -> KvCacheInfo | None:
    """The KV cache a new context reported in llama.cpp's log (None: no cache was logged)."""
    found = [m for line in lines if (m := _KV_LINE.search(line))]
    if not found:
        return None
    return KvCacheInfo(
        type_k=found[0].group(2),
        type_v=found[0].group(4),
        k_mib=sum(float(m.group(3)) for m in found),
        v_mib=sum(float(m.group(5)) for m in found),
    )


def flash_attn_resolved(config: LoadConfig, lines: list[str]) -> Literal["on", "off", "unknown"]:
    """Whether a new context runs flash attention: as asked, or with "auto" as llama.cpp resolved it (on with a
    quantized V cache; else on where the backend of every layer's device has the kernel, as its log says)."""
    if config.flash_attn == "off":
        return "off"
    if config.flash_attn_forced:
        return "on"
    for line in reversed(lines):
        if m := _FLASH_ATTN_PROBE.search(line):
            return "on" if m.group(1) == "enabled" else "off"
    return "unknown"


def kv_overrides(config: LoadConfig, info: ModelInfo) -> ctypes.Array[lib.llama_model_kv_override] | None:
    """The metadata overrides of config (expert_used_count), in llama.cpp's layout; None: none."""
    if config.expert_used_count is None:
        return None
    arr = (lib.llama_model_kv_override * 2)()  # the last entry (empty key) ends the list
    arr[0].key = f"{info.architecture}.expert_used_count".encode()
    arr[0].tag = lib.LLAMA_KV_OVERRIDE_TYPE_INT
    arr[0].value.val_i64 = config.expert_used_count
    arr[1].key = b""
    return arr


def buft_overrides(config: LoadConfig, info: ModelInfo) -> Any:
    """The buffer-type overrides that keep config.cpu_expert_layers' experts on the CPU, and the MTP blocks' where
    they are loaded (llama.cpp offloads them first); None: none."""
    mtp = range(info.n_layer - info.n_nextn, info.n_layer) if config.load_mtp and config.n_gpu_layers else ()
    cpu = {*(config.cpu_expert_layers or ()), *mtp}
    if not cpu:
        return None
    layers = "|".join(str(i) for i in sorted(cpu))
    return native.cpu_overrides([rf"^blk\.({layers})\.ffn_(gate_up|up|gate|down)_exps"])


def context_params(config: LoadConfig, n_ctx: int, n_threads: int) -> Any:
    """llama_context_params of config for a context of n_ctx tokens."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = min(config.n_batch, n_ctx)
    cparams.n_ubatch = min(config.n_ubatch, cparams.n_batch)
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.flash_attn_type = _FLASH_ATTN_TYPE[config.flash_attn]
    cparams.type_k = ggml_type(config.cache_type_k)
    cparams.type_v = ggml_type(config.cache_type_v)
    cparams.op_offload = config.op_offload
    return cparams


class NativeHandle:
    """The model, vocabulary and context pointers of one Engine; ctx/model/vocab raise once it is freed."""

    def __init__(self, path: Path, config: LoadConfig, info: ModelInfo) -> None:
        """Load the model at path and create its context (ModelLoadError when llama.cpp cannot)."""
        self.name = path.name  # for the messages
        lib.llama_backend_init()
        # before the model holds a device: a self-test reaches a device (an RPC server serves one client at a time)
        self.device_ids = device_ids.resolve(config.device_ids)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP if config.use_mmap else lib.LLAMA_LOAD_MODE_NONE
        mparams.use_extra_bufts = config.use_extra_bufts
        mparams.load_mtp = config.load_mtp
        # both arrays are read by llama.cpp while it loads: kept alive with the handle
        self.kv_overrides = kv_overrides(config, info)
        self.buft_overrides = buft_overrides(config, info)
        if self.buft_overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(self.buft_overrides, ctypes.c_void_p)  # pyright: ignore[reportAttributeAccessIssue]  # a pointer field the stub types as an array
        if self.kv_overrides is not None:
            mparams.kv_overrides = self.kv_overrides
        mark = native.log_mark()
        self._model_p: Any = lib.llama_model_load_from_file(os.fsencode(path), mparams)  # any file name bytes
        if not self._model_p:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: {native.recent_error(mark)[-400:]}"
                " (run with --debug for the full log)"
            )
        self._vocab_p: Any = lib.llama_model_get_vocab(self._model_p)
        assert self._vocab_p is not None  # a loaded model always has one
        self._ctx_p: Any = None
        self._path, self._config = path, config
        try:
            self._init_context(path, config)
        except ModelLoadError:
            lib.llama_model_free(self._model_p)
            self._model_p = None
            raise

    def _init_context(self, path: Path, config: LoadConfig) -> None:
        n_ctx_train = lib.llama_model_n_ctx_train(self.model)
        n_ctx = config.n_ctx or min(n_ctx_train, 4096)
        self.n_threads = config.n_threads or default_threads()
        cparams = context_params(config, n_ctx, self.n_threads)
        mark = native.log_mark()
        with native.captured_log() as logged:
            self._ctx_p = lib.llama_init_from_model(self._model_p, cparams)
        if not self._ctx_p:
            raise ModelLoadError(
                f"llama.cpp could not create a context of {n_ctx} tokens for {path}: "
                f"{native.recent_error(mark)[-300:]}; try a smaller `n_ctx`"
            )
        self.n_ctx: int = lib.llama_n_ctx(self.ctx)
        for choice in self.device_ids:
            native.moe_set_device_ids(self.ctx, native.GgmlDevice(choice.handle), choice.raw)
        if os.environ.get("EDGEMOE_CHECK_IDS", "") not in ("", "0"):
            native.moe_set_ids_check(self.ctx, True)  # doctor, the GPU check: every device id row checked
        self.n_batch: int = cparams.n_batch
        self.n_ubatch: int = cparams.n_ubatch
        self.graph_nodes = graph_nodes_logged(logged)
        # what "auto" resolved to ("unknown" only where llama.cpp's log did not say)
        self.flash_attn = flash_attn_resolved(config, logged)
        self.kv_cache: KvCacheInfo | None = kv_cache_logged(logged)  # None: the model has no KV cache

    def resize(self, n_ctx: int) -> None:
        """Free the context and create one of n_ctx tokens in its place (same model, same settings): the KV cache,
        everything set on the context (hook, expert cache, gating, predictors) and its compute buffers go with
        the old one, so the caller re-applies them (edgemoe.runtime.context_tiers). ModelLoadError where llama.cpp
        cannot create it (a context of the old size is then made again, empty)."""
        old = self.n_ctx
        lib.llama_free(self.ctx)
        self._ctx_p = None
        try:
            self._init_context(self._path, replace(self._config, n_ctx=n_ctx))
        except ModelLoadError:
            self._init_context(self._path, replace(self._config, n_ctx=old))  # the size that fitted before
            raise

    def _get(self, pointer: Any) -> Any:
        if pointer is None:
            raise EngineClosedError(f"this Engine of {self.name} is closed: open a new one")
        return pointer

    @property
    def is_open(self) -> bool:
        return self._ctx_p is not None

    @property
    def ctx(self) -> Any:
        """The llama_context (EngineClosedError once freed)."""
        return self._get(self._ctx_p)

    @property
    def model(self) -> Any:
        return self._get(self._model_p)

    @property
    def vocab(self) -> Any:
        self._get(self._ctx_p)  # the vocabulary goes with the model
        return self._get(self._vocab_p)

    def free(self) -> None:
        """Free the context, then the model; freeing twice is fine."""
        if self._ctx_p:
            lib.llama_free(self._ctx_p)
            self._ctx_p = None
        if self._model_p:
            lib.llama_model_free(self._model_p)
            self._model_p = None
