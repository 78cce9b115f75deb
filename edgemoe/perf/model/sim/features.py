"""The features of a simulated configuration, in the order the run asks them (feature.py): which of the
config's fields turn on which `Feature`, each a fresh object per run (some keep state across its steps)."""

from __future__ import annotations

from ....policies.daop import precalc_targets
from ....policies.residency import ResidencyPolicy
from ..costmodel import ModelShape
from ..profile import MachineProfile
from .assignment import Assignment
from .cache import ExpertCache
from .config import Config
from .decode_split import DecodeSplit
from .device_prefill import DevicePrefill
from .feature import Feature
from .gating import Gate
from .host_routed import HostRouted
from .offload import OpOffload
from .overlap import Overlap
from .precalc import Precalc
from .refill import RefillingCache
from .stock import GpuExpertLayers


def config_features(
    cfg: Config, shape: ModelShape, prof: MachineProfile, policy: ResidencyPolicy | None, *, overlap: bool
) -> list[Feature]:
    """`cfg`'s features with `policy` replayed as its expert cache (None: no cache). `overlap` is edgemoe's
    (with a cache): stock llama.cpp runs a layer's branches in turn."""
    out: list[Feature] = []
    if cfg.gpu_expert_layers:
        out.append(GpuExpertLayers(cfg.gpu_expert_layers))
    if policy is not None:
        out.append(RefillingCache(policy, cfg.refilling) if cfg.refilling else ExpertCache(policy))
    if cfg.gated:
        out.append(Gate())
    if cfg.assign is not None:
        out.append(Assignment(cfg.assign))
    if cfg.device_prefill:
        out.append(DevicePrefill())
    if prof.gpu is not None and prof.gpu.op_offload:
        out.append(OpOffload())
    if cfg.precalc is not None and policy is not None:
        targets = precalc_targets(shape.moe_layers, cfg.precalc.first_layer)
        out.append(Precalc(cfg.precalc, frozenset(il for il in targets if cfg.slots.get(il, 0) > 0)))
    if cfg.decode_split:
        out.append(DecodeSplit())
    if cfg.host_routed:
        out.append(HostRouted(cfg.slots))
    if overlap and cfg.policy is not None:
        out.append(Overlap())
    return out
