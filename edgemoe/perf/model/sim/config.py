"""A simulated configuration (`Config`: a stock placement or an edgemoe policy with its features) and the
simulator's constants: graph nodes each feature adds, llama.cpp's op offload threshold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OFFLOAD_MIN_TOKENS = 32  # llama.cpp's CUDA backend offloads an op on host weights from this batch size
CPU_NODES_PER_SPLIT = 8  # graph nodes a layer's CPU expert branch adds (mul_mat_id x3, glu, weights, sums)
GATE_NODES_PER_LAYER = 2  # ggml_moe_gate ids + weights
CACHE_NODES_PER_LAYER = 12  # the expert cache's second expert FFN and its table lookups
# DAOP's pre-calculation per target layer: router product, top-k, table lookup, the early FFN (three
# mul_mat_id, glu), the two CPU operations and the add
PRECALC_NODES_PER_LAYER = 12
# a decode split per MoE layer: the CPU's partial FFN and the GPU's (three mul_mat_id and the glu each) and the add
SPLIT_NODES_PER_LAYER = 9


@dataclass(frozen=True)
class PrecalcSpec:
    """DAOP's pre-calculation (generate's --precalc-from) as the simulator projects it, from rates
    measured through llama.cpp (tools/precalc_eval.py, docs/research/daop.md): in a decode step, at each cached MoE layer
    from `first_layer` on that follows a MoE layer, a share `recall` of the layer's CPU expert work was computed a
    layer early (`early_share`), and `recall * (1 - precision) / precision` as much again was computed early for
    nothing (predicted, not routed). The early work starts with the layer, on the CPU, while the GPU computes the
    layer's attention and router (the scheduler's overlap; without it, in turn); the rest runs as before."""

    first_layer: int
    recall: float
    precision: float

    def __post_init__(self) -> None:
        if self.first_layer < 1:
            raise ValueError(
                f"pre-calculation needs a layer before its first target: first_layer {self.first_layer}"
            )
        if not (0.0 <= self.recall <= 1.0 and 0.0 < self.precision <= 1.0):
            raise ValueError(
                f"recall must be in [0, 1] and precision in (0, 1], not {self.recall}, {self.precision}"
            )

    @property
    def wasted(self) -> float:
        """Work computed early for nothing, per unit of a target layer's CPU expert work."""
        return self.recall * (1.0 - self.precision) / self.precision


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "stock" | "edgemoe"
    gpu_expert_layers: frozenset[int] = frozenset()  # layers whose experts all live on the GPU (stock)
    policy: str | None = None  # edgemoe expert cache policy
    slots: Mapping[int, int] = field(default_factory=dict)  # per MoE layer
    gated: bool = False
    blocking: bool = False
    assign: str | None = (
        None  # prefill ubatches: DALI's CPU/GPU assignment (edgemoe.policies.assignment) by name
    )
    # prefill ubatches run every routed expert on the GPU, the experts outside the slots copied into a prefill
    # buffer one cached layer ahead on the copy stream (--device-prefill, all ahead)
    device_prefill: bool = False
    precalc: PrecalcSpec | None = None  # decode steps pre-calculate (--precalc-from)
    # decode steps split the CPU's experts by rows with the GPU where that is faster (FreeToken-style; not built)
    decode_split: bool = False
    # other engines' caches (the backtest, edgemoe.perf.model.backtest): loads copied from pageable host memory (the
    # driver stages them: h2d_pageable), where edgemoe's loader sends its chunks from pinned staging buffers
    pageable_loads: bool = False
    # the host reads each cached layer's routing before its experts run, one device-to-host synchronisation
    host_routed: bool = False
    # the run starts right after a prompt prefilled in these layers' slots (--device-prefill-borrow): their
    # placement is copied as it starts, each expert on the CPU until its load lands (sim/refill.py)
    refilling: frozenset[int] = frozenset()
