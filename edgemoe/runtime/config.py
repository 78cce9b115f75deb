"""How a model is loaded: LoadConfig (llama.cpp model and context parameters) and the thread default."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, TypedDict

from ..errors import InvalidConfigError
from ..gguf.kv_types import FLASH_ATTN, KV_CACHE_TYPES, FlashAttn, KvCacheType, block_size, is_quantized

# ggml's GGML_MAX_N_THREADS: the threadpool has this many slots and aborts above it. Any count up
# to it works (more threads than cores only oversubscribe them), so this is the bound, not a
# multiple of os.cpu_count(): a command that runs on a big machine still runs on a small one.
MAX_THREADS = 512


def default_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2  # llama.cpp runs best on physical cores


DEFAULT_MAX_CTX = 4096  # the context of LoadConfig(n_ctx=0) is the model's training context, capped here


def planned_ctx(n_ctx: int, n_ctx_train: int) -> int:
    """The context a LoadConfig(n_ctx) gives a model trained at n_ctx_train (0: unknown), for sizing its KV cache
    before loading (the engine's rule; llama.cpp may round it up to a multiple of 256)."""
    return n_ctx or min(n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)


# how a device's mul_mat_id / add_id get skipped ids (edgemoe.runtime.device_ids): "auto" runs each device's recorded
# id-row self-test, "raw" / "fill" force one mode on every device
DeviceIdsSetting = Literal["auto", "raw", "fill"]
DEVICE_IDS_SETTINGS: tuple[DeviceIdsSetting, ...] = ("auto", "raw", "fill")

DEFAULT_BATCH = 512  # LoadConfig's n_batch and n_ubatch: what the CPU tests compare bitwise against stock at


def check_batches(n_batch: int | None, n_ubatch: int | None, n_ctx: int) -> None:
    """Refuse a batch or ubatch given by the user that llama.cpp would clamp or refuse (None: not given): each
    at least 1, the ubatch at most the batch and neither beyond a context of n_ctx tokens (0: not known yet)."""
    for name, n in (("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if n is not None and n < 1:
            raise InvalidConfigError(f"`{name}={n}`: give at least 1 token")
        if n is not None and n_ctx and n > n_ctx:
            raise InvalidConfigError(f"`{name}={n}`: the context holds {n_ctx} tokens; give at most that")
    if n_batch is not None and n_ubatch is not None and n_ubatch > n_batch:
        raise InvalidConfigError(
            f"`n_ubatch={n_ubatch}` is larger than `n_batch={n_batch}`: give a ubatch of at most the batch"
        )


class LoadOptions(TypedDict, total=False):
    """The LoadConfig fields a placement forwards as they are (edgemoe.placement.plan, open_engine: typed
    **kwargs); LoadConfig's comments say what each means."""

    n_threads: int
    n_gpu_layers: int
    n_batch: int
    n_ubatch: int
    flash_attn: FlashAttn
    cache_type_k: KvCacheType
    cache_type_v: KvCacheType
    load_mtp: bool
    cpu_expert_layers: (
        tuple[int, ...] | None
    )  # stock's `-ot exps=CPU` / --n-cpu-moe layers (bench's stock rows)


@dataclass(frozen=True)
class LoadConfig:
    n_ctx: int = 0  # context length; 0 = the model's training context, capped at 4096
    n_batch: int = DEFAULT_BATCH  # tokens per llama_decode call during prefill (llama.cpp's -b)
    n_ubatch: int = DEFAULT_BATCH  # physical micro-batch, at most n_batch (llama.cpp's -ub)
    n_threads: int = 0  # 0 = default_threads()
    n_gpu_layers: int = 0  # layers offloaded by stock llama.cpp (experts handled by later patches)
    use_mmap: bool = True
    # "auto": on where the backend supports it (llama.cpp's default); True/False of older configs read as on/off
    flash_attn: FlashAttn = "auto"
    cache_type_k: KvCacheType = "f16"  # the K cache's type (llama.cpp's -ctk)
    cache_type_v: KvCacheType = (
        "f16"  # the V cache's; a quantized one needs flash attention (llama.cpp's -ctv)
    )
    expert_used_count: int | None = None  # override the model's top-k (stock llama.cpp's --override-kv)
    # CPU weight repacking (llama.cpp's default); equality tests of the expert cache load both sides
    # with False, so that the CPU and the stand-in cache run the same kernels
    use_extra_bufts: bool = True
    # MoE layers whose routed experts stay in CPU memory while n_gpu_layers offloads the rest
    # (llama.cpp's -ot exps=CPU for all of them, --n-cpu-moe N for the first N); None: llama.cpp decides
    cpu_expert_layers: tuple[int, ...] | None = None
    op_offload: bool = True  # llama.cpp moves big-batch ops on host weights to a GPU (its default)
    # load the model's MTP (NextN) blocks, for speculation with them (edgemoe.runtime.mtp); their experts stay
    # in CPU memory
    load_mtp: bool = False
    # skipped ids on a device: "auto" (its id-row self-test, recorded once per device and build; EDGEMOE_DEVICE_IDS
    # overrides it), "raw" (-1 as is) or "fill" (spare rows and a mask) on every device; docs/architecture.md
    device_ids: DeviceIdsSetting = "auto"

    def __post_init__(self) -> None:
        if self.device_ids not in DEVICE_IDS_SETTINGS:
            raise InvalidConfigError(
                f"device_ids {self.device_ids!r}: use one of {', '.join(DEVICE_IDS_SETTINGS)}"
            )
        fa: object = self.flash_attn
        if isinstance(fa, bool):  # the bool of edgemoe <= 0.x configs
            object.__setattr__(self, "flash_attn", "on" if fa else "off")
        elif fa not in FLASH_ATTN:
            raise InvalidConfigError(f"`flash_attn={fa!r}`: use one of {', '.join(FLASH_ATTN)}")
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in KV_CACHE_TYPES:
                raise InvalidConfigError(
                    f"`{name}={getattr(self, name)!r}`: use one of {', '.join(KV_CACHE_TYPES)}"
                )
        if is_quantized(self.cache_type_v) and self.flash_attn == "off":
            raise InvalidConfigError(
                f"`cache_type_v={self.cache_type_v!r}` needs flash attention (llama.cpp reads a quantized V cache "
                "only in it): set `flash_attn='on'` or `flash_attn='auto'`, or `cache_type_v='f16'`"
            )

    @property
    def flash_attn_forced(self) -> bool:
        """Flash attention runs whatever the backend supports: asked for, or "auto" with a quantized V cache
        (llama.cpp turns it on then rather than refuse)."""
        return self.flash_attn == "on" or (self.flash_attn == "auto" and is_quantized(self.cache_type_v))

    def validate_kv_shape(self, *, n_embd_head_k: int, n_embd_head_v: int, mla: bool) -> None:
        """Refuse KV cache types llama.cpp refuses for a model of these head sizes (MLA: the deepseek2 family)."""
        if mla and self.cache_type_k != self.cache_type_v:
            raise InvalidConfigError(
                f"`cache_type_k={self.cache_type_k!r}` and `cache_type_v={self.cache_type_v!r}`: this model (MLA) "
                "caches K and V as one type; give both the same"
            )
        if self.flash_attn == "off":
            return  # llama.cpp checks the block sizes only for flash attention's reads
        checks: tuple[tuple[str, KvCacheType, int], ...] = (
            ("cache_type_k", self.cache_type_k, n_embd_head_k),
            ("cache_type_v", self.cache_type_v, n_embd_head_v),
        )
        for name, kind, head in checks:
            if head % block_size(kind):
                raise InvalidConfigError(
                    f"`{name}={kind!r}`: its blocks of {block_size(kind)} values do not divide this model's "
                    f"head size {head}; use f16 or bf16"
                )

    def validate(self, *, n_expert: int, n_expert_used: int) -> None:
        """Refuse values llama.cpp would abort on, with a message that says what to pass instead.

        The expert_used_count override is checked against the model's expert count here; whether
        llama.cpp's graph can sum that many experts is `edgemoe.gguf.validate.validate_hparams`'s.
        """
        if not 0 <= self.n_threads <= MAX_THREADS:
            raise InvalidConfigError(
                f"{self.n_threads} threads: use 1..{MAX_THREADS} (0 picks the physical cores)"
            )
        if self.n_ctx < 0 or self.n_batch < 1 or self.n_ubatch < 1:
            raise InvalidConfigError(
                f"context {self.n_ctx}, batch {self.n_batch}, ubatch {self.n_ubatch}: "
                "the context must be >= 0 (0: the model's) and the batches >= 1"
            )
        if self.n_ubatch > self.n_batch:
            check_batches(self.n_batch, self.n_ubatch, 0)  # llama.cpp would clamp it silently
        k = self.expert_used_count
        if k is not None and n_expert == 0:
            raise InvalidConfigError(
                "expert_used_count is set but the model has no routed experts: leave it unset"
            )
        if k is not None and not 1 <= k <= n_expert:
            raise InvalidConfigError(
                f"expert_used_count {k}: use 1..{n_expert} (the model routes to "
                f"{n_expert_used} of {n_expert} experts per token)"
            )
