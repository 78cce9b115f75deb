"""One configuration's replay of a workload on the GPU, timed (edgemoe.perf.model.sim): the prefill plan's
prompts, the prefill backtest's rows and the decode right after a prompt all go through it."""

from __future__ import annotations

from typing import Any

from ...policies.residency import make_policy
from .costmodel import ModelShape
from .profile import MachineProfile
from .sim.config import Config
from .sim.feature import Acc
from .sim.features import config_features
from .sim.run import Run
from .workload import Workload


def replay_prompt(
    shape: ModelShape,
    prof: MachineProfile,
    cfg: Config,
    work: Workload,
    *,
    nodes: tuple[int, int],
    frequency: Any = None,
) -> tuple[float, float, str]:
    """(tok/s, seconds, the busiest resource) of a workload's steps through `cfg` on the GPU; a cache policy that
    places by routing counts takes `frequency`."""
    policy = None
    if cfg.policy is not None:
        policy = make_policy(cfg.policy, dict(cfg.slots), n_expert=shape.n_expert, frequency=frequency)
    features = config_features(cfg, shape, prof, policy, overlap=cfg.kind == "edgemoe")
    run = Run(shape, prof, nodes, features, on_gpu=True)
    acc = Acc()
    for s in work.steps:
        run.step(s, acc)
    n = sum(s.n_tokens for s in work.steps)
    return (n / acc.time if acc.time else 0.0), acc.time, _bound(acc, prof, pinned=cfg.device_prefill)


def _bound(acc: Acc, prof: MachineProfile, *, pinned: bool) -> str:
    """The resource busiest over a prefill: the copies over the link (--device-prefill's at the pinned rate, op
    offload's at the pageable one, which the run counts in the GPU's time: op offload copies, then computes), the
    GPU's compute, the CPU's, or the host's launches and calls."""
    link = prof.link
    rate = (link.loads_bw if pinned else link.h2d_pageable) if link is not None else 0.0
    copy = acc.pcie / rate if rate else 0.0
    gpu = acc.gpu if pinned else acc.gpu - copy
    busy = {"copy": copy, "gpu": gpu, "cpu": acc.cpu, "host": acc.host}
    return max(busy, key=lambda k: busy[k])
