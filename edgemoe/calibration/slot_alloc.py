"""Per-layer expert-cache slots from a calibration: the `routing` stage and the --alloc choice.

The ``routing`` stage keeps a compact copy of the calibration traces' routing (routing_trace.npz:
the selected ids, phase and sequence of each token, no gate inputs) so that DP allocation
(edgemoe.policies.allocation) can replay it through any residency policy at run time.
`allocate_slots` turns --alloc, --expert-slots / --vram and the policy into slots per MoE layer:
``dp`` when the calibration has a routing trace, else ``equal`` with a note saying why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..policies.allocation import decode_steps, dp_allocate, f_curves, layer_steps, replay_config, total_cost
from ..policies.registry import policy_spec
from ..policies.residency import DALI_WINDOW, load_frequency
from .card import CalibrationError, cache_dir

if TYPE_CHECKING:
    from ..gguf.info import ModelInfo
    from .stages import StageContext

log = logging.getLogger(__name__)

ROUTING_TRACE = "routing_trace.npz"
ROUTING_TOKENS = 16384  # tokens the routing stage keeps (whole sequences, spread over the trace)
ALLOC_MODES = ("equal", "dp")
CURVES_FORMAT = 1  # of the cached replay curves: bump when the replay's semantics change


def routing_stage(ctx: StageContext) -> dict[str, Any]:
    """Write routing_trace.npz: the routing of whole calibration sequences, evenly spread over the
    trace, at most ROUTING_TOKENS tokens (option {"routing": {"tokens": N}})."""
    tr = ctx.traces()
    budget = int(ctx.options.get("routing", {}).get("tokens") or ROUTING_TOKENS)
    seqs = np.unique(tr.seq)
    per_seq = max(1, math.ceil(tr.n_tokens / len(seqs)))
    n_keep = max(1, min(len(seqs), budget // per_seq))
    keep = seqs[np.unique(np.linspace(0, len(seqs) - 1, n_keep).round().astype(int))]
    rows = np.isin(tr.seq, keep)
    ubatch = int(tr.meta.get("n_batch") or ctx.ctx)
    with (ctx.out_dir / ROUTING_TRACE).open("wb") as f:
        np.savez_compressed(
            f,
            layers=tr.layers.astype(np.int32),
            ids=tr.ids[rows].astype(np.int16),
            phase=tr.phase[rows],
            seq=tr.seq[rows],
            ubatch=np.int32(ubatch),
            n_expert=np.int32(tr.n_expert),
        )
    return {"file": ROUTING_TRACE, "tokens": int(rows.sum()), "sequences": len(keep), "ubatch": ubatch}


@dataclass(frozen=True)
class RoutingTrace:
    """A calibration's routing_trace.npz."""

    layers: tuple[int, ...]
    ids: np.ndarray  # (T, L, k) int16, -1: dropped
    phase: np.ndarray  # (T,) 0 prefill, 1 decode
    seq: np.ndarray  # (T,)
    ubatch: int  # tokens per prefill ubatch when it was recorded
    n_expert: int

    @classmethod
    def load(cls, calibration: Path, *, info: ModelInfo | None = None) -> RoutingTrace:
        path = calibration / ROUTING_TRACE
        if not path.exists():
            raise CalibrationError(
                f"{calibration} has no {ROUTING_TRACE}: run `edgemoe calibrate MODEL "
                f"--corpus FILE` (or add it: `edgemoe calibrate MODEL --corpus FILE --out "
                f"{calibration} --update --stage routing` with the card's corpora, "
                "`tokens`, `ctx` and `seed`)"
            )
        with np.load(path) as z:
            tr = cls(
                layers=tuple(int(x) for x in z["layers"]),
                ids=z["ids"],
                phase=z["phase"],
                seq=z["seq"],
                ubatch=int(z["ubatch"]),
                n_expert=int(z["n_expert"]),
            )
        if info is not None and (tr.n_expert != info.n_expert or tr.layers != tuple(info.moe_layers)):
            raise CalibrationError(
                f"{path} is of another model ({tr.n_expert} experts in MoE layers "
                f"{list(tr.layers)}, the model has {info.n_expert} in "
                f"{list(info.moe_layers)}): run `edgemoe calibrate MODEL --corpus FILE` "
                "for this model, or pass its `calibration`"
            )
        return tr

    def steps(self) -> dict[int, list[np.ndarray]]:
        return layer_steps(self.ids, self.layers, self.phase, self.seq, ubatch=self.ubatch)

    def decode_mask(self) -> np.ndarray | None:
        """Which steps are decode tokens (None when it has none: then every step counts)."""
        mask = decode_steps(self.phase, self.seq, ubatch=self.ubatch)
        return mask if mask.any() else None


@dataclass(frozen=True)
class SlotAllocation:
    alloc: str  # "dp" or "equal": what was used
    slots: dict[int, int]  # MoE layer -> slots
    note: str | None = None  # why dp was not used, when it was asked for or expected


def allocate_slots(
    info: ModelInfo,
    *,
    alloc: str | None,
    policy: str,
    calibration: Path | None,
    slots_per_layer: int,
    budget_bytes: int | None = None,
    dali_window: int = DALI_WINDOW,
    dali_update: int | None = None,
) -> SlotAllocation:
    """Slots per MoE layer for --alloc `alloc` (None: dp when `calibration` has a routing trace).

    equal gives every MoE layer `slots_per_layer`. dp minimises the misses per decode token of
    `policy` replayed over the calibration's routing trace (its prefills replayed, not counted:
    they are 3/4 of the calibration tokens, in ubatches of hundreds of tokens, and would decide
    the allocation for prompt processing) under the same budget: `budget_bytes` of expert
    slots when given (--vram; each layer's slot costs its own bytes per expert), else
    slots_per_layer times the MoE layers (--expert-slots N: N on average). Either way dp hands out at
    most the slots equal allocation does: with bytes, layers with smaller experts (a Q4_K_M file's
    Q4_K ffn_down beside Q6_K ones) could otherwise take more slots than were asked.
    """
    if alloc is not None and alloc not in ALLOC_MODES:
        raise CalibrationError(f"unknown `alloc={alloc!r}`: use {' or '.join(ALLOC_MODES)}")
    layers = list(info.moe_layers)
    equal = SlotAllocation("equal", {il: slots_per_layer for il in layers})
    if alloc == "equal" or not layers:
        return equal
    spec = policy_spec(policy)
    if not spec.replayable:
        return _fallback(
            equal,
            alloc,
            f"the {policy} policy loads nothing by itself, so there is nothing for "
            "dp to replay; equal allocation",
        )
    if calibration is None:
        if alloc is None:
            return equal
        return _fallback(
            equal,
            alloc,
            "`alloc='dp'` needs a calibration with a routing trace: run `edgemoe "
            "calibrate MODEL --corpus FILE` (or pass `calibration`); equal "
            "allocation for now",
        )
    try:
        trace = RoutingTrace.load(calibration, info=info)
    except CalibrationError as err:
        if "another model" in str(err):
            raise
        return _fallback(
            equal, alloc, f"dp allocation needs a routing trace: {err}; equal allocation for now"
        )
    t0 = time.perf_counter()
    if spec.replay_as is not None:
        # e.g. promoe's replacement is an LRU; its prefetches need router inputs, which the routing trace does not keep
        log.info(
            "dp allocation for %s: %s's replayed misses (its prefetches are not replayed)",
            policy,
            spec.replay_as,
        )
        policy = spec.replay_as
    curves = decode_curves(calibration, trace, info, policy, dali_window=dali_window, dali_update=dali_update)
    slots = _dp_slots(info, curves, equal.slots, budget_bytes)
    log.info(
        "dp allocation for %s from %s (%d tokens) in %.2f s: %s",
        policy,
        calibration / ROUTING_TRACE,
        trace.ids.shape[0],
        time.perf_counter() - t0,
        slots,
    )
    return SlotAllocation("dp", slots)


def _dp_slots(
    info: ModelInfo, curves: dict[int, np.ndarray], equal: dict[int, int], budget_bytes: int | None
) -> dict[int, int]:
    """dp's slots over the misses `curves`: within `budget_bytes` of expert slots (never worse than `equal`)
    when given, else as many slots as `equal` hands out."""
    asked = sum(equal.values())  # dp redistributes the slots equal allocation gives; it never adds
    if budget_bytes is None:
        return dp_allocate(curves, asked)
    slots = dp_allocate(
        curves, budget_bytes, bytes_per_expert=dict(info.bytes_per_expert_by_layer), max_total=asked
    )
    if total_cost(curves, slots) > total_cost(curves, equal):  # the greedy trim can lose to equal
        slots = dict(equal)
    return slots


def decode_curves(
    calibration: Path,
    trace: RoutingTrace,
    info: ModelInfo,
    policy: str,
    *,
    dali_window: int = DALI_WINDOW,
    dali_update: int | None = None,
) -> dict[int, np.ndarray]:
    """f_i(t) of `policy` on the calibration's routing trace, misses per decode token, for t = 0..n_expert.

    Replaying every t of every layer takes about a minute on a 48-layer, 128-expert model, so the
    curves are kept in the per-user cache, keyed by the trace's (and for static the frequencies')
    bytes and the policy's parameters.
    """
    frequency = None
    files = [calibration / ROUTING_TRACE]
    phase = policy_spec(policy).frequency_phase  # static: all counts, daop: its decode-phase counts
    if phase is not None:
        frequency = load_frequency(
            calibration, n_expert=info.n_expert, layers=list(info.moe_layers), phase=phase
        )
        files.append(calibration / "router_frequency.npz")
    params: dict[str, Any] = {
        "format": CURVES_FORMAT,
        "policy": policy,
        "n_expert": info.n_expert,
        "counted": "decode",
    }
    params.update(replay_config(policy, window=dali_window, update=dali_update).replay_key(info.n_expert))
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for f in files:
        digest.update(f.read_bytes())
    path = cache_dir() / "allocation" / f"curves-{digest.hexdigest()[:20]}.npz"
    try:
        with np.load(path) as z:
            return {int(il): z["curves"][i] for i, il in enumerate(z["layers"])}
    except (OSError, ValueError, KeyError):  # not cached yet (or unreadable): replay
        pass
    curves = f_curves(
        trace.steps(),
        policy,
        info.n_expert,
        n_expert=info.n_expert,
        frequency=frequency,
        window=dali_window,
        update=dali_update,
        counted=trace.decode_mask(),
    )
    layers = sorted(curves)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with tmp.open("wb") as f:
            np.savez(f, layers=np.array(layers, np.int32), curves=np.stack([curves[il] for il in layers]))
        os.replace(tmp, path)
    except OSError as err:  # no writable cache: replay again next time
        log.info("cannot cache the dp curves in %s: %s", path, err)
    return curves


def _fallback(equal: SlotAllocation, alloc: str | None, why: str) -> SlotAllocation:
    log.info("%s", why)
    return SlotAllocation("equal", equal.slots, note=why)


def describe(allocation: SlotAllocation) -> str:
    """'8 slots per MoE layer' or 'dp: 64 slots over 8 MoE layers, 2..16 per layer'."""
    values = list(allocation.slots.values())
    if allocation.alloc == "equal" and len(set(values)) <= 1:
        return f"{values[0] if values else 0} slots per MoE layer"
    return (
        f"{allocation.alloc}: {sum(values)} slots over {len(values)} MoE layers, "
        f"{min(values)}..{max(values)} per layer"
    )
