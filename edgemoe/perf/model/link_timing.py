"""The copy timing of a machine profile for the timed replay (edgemoe.policies.replay): how many bytes the
host-to-GPU link moves while one MoE layer computes a decode token.

`profile_timing` prices one decode layer of a reference model on a profile (edgemoe.perf.model.costmodel) and
the copy of one of its experts over the profile's link, and scales the bandwidth to another model's
expert size: the other model then copies an expert in the same number of layer times as the reference
does on that machine. That is how the tiny fixtures (experts of 35-128 KiB) are replayed as if they
were Qwen3-30B-A3B (2.5 MiB experts) on an RTX 4060 laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import EdgeMoeError
from ...policies.copy_queue import CopyTiming
from .costmodel import LayerCosts, ModelShape
from .profile import MachineProfile


@dataclass(frozen=True)
class LinkTiming:
    timing: CopyTiming  # for the model whose expert bytes it was scaled to
    experts_per_layer: float  # experts the link copies while a layer computes: the machine's ratio
    layer_s: float
    reference_expert_bytes: int
    label: str


def profile_timing(
    prof: MachineProfile,
    reference: ModelShape,
    expert_bytes: float,
    *,
    name: str,
    kv_len: int = 512,
    pinned: bool = False,
    experts_on: str = "cpu",
) -> LinkTiming:
    """One decode MoE layer of `reference` on `prof` (dense matrices and attention on the GPU, the k routed
    experts on the CPU with a hand-off each way, or on the GPU: `experts_on`), and the link's pageable (this
    build copies from the mapped GGUF) or pinned bandwidth, scaled to experts of `expert_bytes`."""
    if prof.gpu is None or prof.link is None:
        raise EdgeMoeError(f"profile {name} has no GPU or no link: the copy timing needs both")
    if experts_on not in ("cpu", "gpu"):
        raise EdgeMoeError(f"experts_on {experts_on!r}: use cpu or gpu")
    il = reference.moe_layers[0]
    gpu = LayerCosts.of(prof.gpu, reference)
    layer = gpu.dense(il, 1) + gpu.attention(il, 1, kv_len)
    k = [1] * reference.n_expert_used
    if experts_on == "gpu":
        layer += gpu.experts(il, k)
    else:
        layer += LayerCosts.of(prof.cpu, reference).experts(il, k) + 2 * prof.link.latency_s
    link = prof.link.h2d_pinned if pinned else prof.link.h2d_pageable
    ref_bytes = reference.expert_bytes(il)
    ratio = layer * link / ref_bytes
    label = (
        f"{name}, {'pinned' if pinned else 'pageable'} {link / 1e9:.1f} GB/s, {reference.name} layer of "
        f"{layer * 1e6:.0f} us (experts on the {experts_on.upper()}): {ratio:.2f} experts per layer time"
    )
    return LinkTiming(
        CopyTiming(bandwidth=ratio * expert_bytes / layer, layer_s=layer), ratio, layer, ref_bytes, label
    )
