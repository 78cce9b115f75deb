"""How a model is loaded: LoadConfig (llama.cpp model and context parameters) and the thread default."""
from __future__ import annotations

import os
from dataclasses import dataclass


def default_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2  # llama.cpp runs best on physical cores


@dataclass(frozen=True)
class LoadConfig:
    n_ctx: int = 0  # context length; 0 = the model's training context, capped at 4096
    n_batch: int = 512  # tokens per llama_decode call during prefill
    n_ubatch: int = 512  # physical micro-batch
    n_threads: int = 0  # 0 = default_threads()
    n_gpu_layers: int = 0  # layers offloaded by stock llama.cpp (experts handled by later patches)
    use_mmap: bool = True
    flash_attn: bool = False  # off, as llama-cpp-python's default (llama.cpp's own default is "auto")
    expert_used_count: int | None = None  # override the model's top-k (stock llama.cpp's --override-kv)
    # CPU weight repacking (llama.cpp's default); equality tests of the expert cache load both sides
    # with False, so that the CPU and the stand-in cache run the same kernels
    use_extra_bufts: bool = True
    # MoE layers whose routed experts stay in CPU memory while n_gpu_layers offloads the rest
    # (llama.cpp's -ot exps=CPU for all of them, --n-cpu-moe N for the first N); None: llama.cpp decides
    cpu_expert_layers: tuple[int, ...] | None = None
    op_offload: bool = True  # llama.cpp moves big-batch ops on host weights to a GPU (its default)
