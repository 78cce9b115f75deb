"""llama.cpp's op offload: from a batch of OFFLOAD_MIN_TOKENS tokens, a device with `op_offload` (CUDA,
not the RPC backend) copies the experts an op uses from host memory (pageable) and computes them itself."""

from __future__ import annotations

from .config import OFFLOAD_MIN_TOKENS
from .feature import Acc, Feature, MissTimes, MoeLayer
from .state import RunState


class OpOffload(Feature):
    def misses(self, run: RunState, lay: MoeLayer, gpu_s: float, acc: Acc) -> MissTimes | None:
        if lay.n_tokens < OFFLOAD_MIN_TOKENS:
            return None
        assert run.gpu is not None and run.prof.link is not None
        nbytes = run.shape.expert_bytes(lay.il) * len(lay.cpu_e)  # op offload copies the used experts
        acc.pcie += nbytes
        g = gpu_s + (nbytes / run.prof.link.h2d_pageable + run.gpu.experts(lay.il, lay.cpu_e))
        return g, 0.0, 0.0
