"""`edgemoe simulate`: replay a routing trace through stock llama.cpp placements and edgemoe's policies
on a machine profile, with an event-level timing model of each decode step and prefill ubatch.

Per step, layer by layer: the layer's matrices and attention run on the GPU (on the CPU without
one); each routed expert runs where it is (a GPU-resident expert on the GPU, the others on the CPU
with a hand-off each way, or, for a prefill ubatch of 32 tokens or more, copied to the GPU for the
op as llama.cpp's op offload does); the expert cache's loads go on a copy stream of their own at the
loader's bandwidth (`LinkProfile.loads_bw`) and a layer that needs a slot still loading waits for it.
Where the engine leaves the load worker off (the RPC device: `load_worker_default`), the caller issues
the loads a step queued when it synchronises after it, so their copy time ends that step on the host. `overlap=False` runs the CPU branch and the GPU
branch of a layer one after the other (llama.cpp's order, and the build's with `CacheConfig(overlap=False)`);
`overlap=True` projects the CPU/GPU overlap the build runs by default with the cache on a device
for edgemoe's configurations: the CPU's experts start once the layer's dense part (attention, router) is
done and run while the GPU computes its experts; stock llama.cpp's always run the two one after the other. Host work per call (Python, sampling) and per graph node comes from the
profile. Everything is a projection: docs/research/performance-model.md says how it was validated.

The replay itself is edgemoe.perf.model.sim: a run over the configuration's features, one module each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...analysis.trace import DECODE, PREFILL
from ...errors import EdgeMoeError
from ...gguf.header import check_gguf
from ...gguf.kv_types import F16_KV, FlashAttn, KvTypes
from ...plan.planner import Device, PlacementPlan, budget_request
from ...plan.planner import plan as plan_placement
from ...plan.reserve import slots_beside_prefill_buffers
from ...policies.daop import precalc_targets
from ...policies.registry import compared_policies, policy_spec
from ...policies.residency import ResidencyPolicy, make_policy
from .costmodel import ModelShape
from .profile import MachineProfile
from .sim.config import Config, PrecalcSpec
from .sim.feature import Acc
from .sim.features import config_features
from .sim.run import Run
from .workload import Workload

__all__ = ["Config", "ConfigResult", "PrecalcSpec", "SimResult", "SimSpec", "run_config", "simulate"]


@dataclass
class ConfigResult:
    name: str
    kind: str
    decode_tps: float
    prefill_tps: float
    ttft_s: float
    hit_rate: float | None  # routed slots served by a GPU-resident expert (None: no cache)
    decode_hit_rate: float | None
    pcie_bytes_per_token: float  # decode: expert bytes copied host-to-device per token
    bottleneck: str  # "gpu" | "cpu" | "pcie" | "host" of decode
    busy: dict[str, float]  # decode share of time each resource works
    note: str = ""


def _phase(cfg: Config) -> str | None:
    """The phase of the router counts cfg's policy places by (static: "all", daop: "decode"), or None."""
    return None if cfg.policy is None else policy_spec(cfg.policy).frequency_phase


@dataclass(frozen=True)
class SimSpec:
    vram: int  # bytes of GPU memory the model may use (0: CPU only)
    n_ctx: int = 4096
    n_ubatch: int = 512
    # the policies to project (default: the registry's comparison, lru and static)
    policies: tuple[str, ...] = field(default_factory=compared_policies)
    gated: bool = False  # the workload carries a gate: add gated variants
    blocking: bool = False
    overlap: bool = False
    calibration: Path | None = None
    assign: str | None = None  # add edgemoe variants whose prefill ubatches use this CPU/GPU assigner
    device_prefill: bool = False  # add edgemoe variants whose prefill ubatches run on the GPU
    precalc: PrecalcSpec | None = None  # add edgemoe variants whose decode steps pre-calculate
    decode_split: bool = (
        False  # add edgemoe variants whose small steps split CPU experts with the GPU (not built)
    )
    slots: Mapping[int, int] | None = (
        None  # edgemoe's slots per MoE layer (None: equal, what the budget leaves)
    )
    # the trace's first sequences only warm the cache (replayed, not counted), as `edgemoe bench` warms up
    warmup_seqs: int = 0
    # decode tokens per step: 1, or speculation's k + 1 (a verification of k proposals; decode_tps then counts
    # the positions verified, edgemoe.perf.model.speculation turns it into tokens at an acceptance rate)
    verify: int = 1
    flash_attn: FlashAttn = "auto"  # the engine's (LoadConfig's): "auto" is on, as llama.cpp resolves it
    kv: KvTypes = F16_KV  # the KV cache's types (-ctk / -ctv): the budget reserves a cache of these
    # stock's --n-cpu-moe (None: the placement's at this budget; a larger ubatch's compute buffer may raise it)
    n_cpu_moe: int | None = None
    # the -device-prefill variants' slots per MoE layer (None: what the budget leaves beside the two buffers)
    device_prefill_slots: Mapping[int, int] | None = None

    @property
    def flash_attn_on(self) -> bool:
        return self.flash_attn != "off"


@dataclass
class SimResult:
    model: str
    profile: str
    vram: int
    slots_per_layer: int
    n_cpu_moe: int | None
    workload_note: str
    configs: list[ConfigResult]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["configs"] = [asdict(c) for c in self.configs]
        return d


def plan_configs(
    shape: ModelShape, prof: MachineProfile, spec: SimSpec, placement: PlacementPlan | None
) -> tuple[list[Config], int, int | None]:
    """Stock placements and edgemoe policies at the budget, as `placement` (the model's at spec.vram and
    spec.n_ctx) splits it; CPU only (no GPU in the profile, or --vram 0: placement None): stock llama.cpp on the
    CPU and edgemoe on the CPU (its gate is the only difference)."""
    moe = shape.moe_layers
    if placement is None:
        cfgs = [Config("stock-cpu", "stock"), Config("edgemoe-cpu", "edgemoe")]
        if spec.gated:
            cfgs.append(Config("edgemoe-cpu-gated", "edgemoe", gated=True))
        return cfgs, 0, None
    budget = placement.budget
    if budget is None or not budget.dense_fits:
        return [], 0, None
    slots = budget.experts_per_layer
    per_layer = dict(spec.slots) if spec.slots is not None else {il: slots for il in moe}
    # --device-prefill's two buffers come out of the slots' budget
    prefill_slots = (
        dict(spec.device_prefill_slots)
        if spec.device_prefill_slots is not None
        else slots_beside_prefill_buffers(shape.info, per_layer, spec.vram, placement.n_ctx)
    )
    n_cpu = placement.n_cpu_moe if spec.n_cpu_moe is None else spec.n_cpu_moe
    cfgs = [Config("stock-ot-exps-cpu", "stock")]
    if n_cpu is not None and n_cpu < len(moe):
        cfgs.append(Config(f"stock-n-cpu-moe-{n_cpu}", "stock", gpu_expert_layers=frozenset(moe[n_cpu:])))
    for pol in spec.policies:
        blocking = spec.blocking
        for gated in (False, True) if spec.gated else (False,):
            cfgs.append(_variant(pol, "-gated" if gated else "", per_layer, blocking, gated=gated))
        if spec.assign is not None:
            cfgs.append(_variant(pol, f"-{spec.assign}-assign", per_layer, blocking, assign=spec.assign))
        if spec.device_prefill:
            cfgs.append(_variant(pol, "-device-prefill", prefill_slots, blocking, device_prefill=True))
        if spec.precalc is not None:
            cfgs.append(_variant(pol, "-precalc", per_layer, blocking, precalc=spec.precalc))
        if spec.decode_split:
            cfgs.append(_variant(pol, "-decode-split", per_layer, blocking, decode_split=True))
    return cfgs, slots, n_cpu


def _variant(pol: str, suffix: str, slots: dict[int, int], blocking: bool, **feature: Any) -> Config:
    """edgemoe with policy `pol` over `slots`, named edgemoe-POL+suffix, with one feature's settings."""
    return Config(f"edgemoe-{pol}{suffix}", "edgemoe", policy=pol, slots=slots, blocking=blocking, **feature)


def run_config(
    cfg: Config,
    work: Workload,
    shape: ModelShape,
    prof: MachineProfile,
    nodes: tuple[int, int],
    *,
    on_gpu: bool,
    overlap: bool = False,
    calibration: Path | None = None,
    frequency: Mapping[int, Any] | None = None,
    policy: ResidencyPolicy | None = None,
    warmup_seqs: int = 0,
    flash_attn: bool = True,
) -> ConfigResult:
    """Replay the workload's steps in order through one configuration. `policy`: a fresh residency policy
    object to replay for cfg.policy instead of one built by name (e.g. with frequencies of another trace).
    Sequences below `warmup_seqs` run (their loads, the policy's state) but are not counted. flash_attn: the
    attention runs llama.cpp's flash-attention kernel."""
    if policy is None and cfg.policy is not None:
        policy = (
            make_policy(  # static and daop place by `frequency` where it is given, else by the calibration's
                cfg.policy,
                dict(cfg.slots),
                blocking=cfg.blocking,
                calibration=calibration,
                n_expert=shape.n_expert,
                frequency=frequency,
            )
        )
    features = config_features(cfg, shape, prof, policy, overlap=overlap)
    run = Run(
        shape, prof, nodes, features, on_gpu=on_gpu, pageable_loads=cfg.pageable_loads, flash_attn=flash_attn
    )
    pre, dec = Acc(), Acc()
    seq_pre: dict[int, float] = {}
    for s in work.steps:
        if s.seq < warmup_seqs:
            run.step(s, Acc())
            continue
        dt = run.step(s, pre if s.phase == PREFILL else dec)
        if s.phase == PREFILL:
            seq_pre[s.seq] = seq_pre.get(s.seq, 0.0) + dt
    counted = [s for s in work.steps if s.seq >= warmup_seqs]
    n_dec = sum(s.n_tokens for s in counted if s.phase == DECODE)
    n_pre = sum(s.n_tokens for s in counted if s.phase == PREFILL)
    hits, slots = pre.hits + dec.hits, pre.hits + dec.hits + pre.misses + dec.misses
    busy = {k: (getattr(dec, k) / dec.time if dec.time else 0.0) for k in ("gpu", "cpu", "host")}
    busy["pcie"] = (dec.pcie / prof.link.loads_bw / dec.time) if prof.link is not None and dec.time else 0.0
    return ConfigResult(
        name=cfg.name,
        kind=cfg.kind,
        decode_tps=n_dec / dec.time if dec.time else 0.0,
        prefill_tps=n_pre / pre.time if pre.time else 0.0,
        ttft_s=sum(seq_pre.values()) / len(seq_pre) if seq_pre else 0.0,
        hit_rate=hits / slots if policy is not None and slots else None,
        decode_hit_rate=dec.hits / (dec.hits + dec.misses)
        if policy is not None and dec.hits + dec.misses
        else None,
        pcie_bytes_per_token=dec.pcie / n_dec if n_dec else 0.0,
        bottleneck=max(busy, key=lambda k: busy[k]) if dec.time else "-",
        busy=busy,
    )


def estimate_graph_nodes(shape: ModelShape) -> tuple[int, int]:
    """Nodes of llama.cpp's graphs when no trace of this model recorded them: about 60 per layer with
    experts, 52 per layer without (the fixtures' counts, 486 and 422 for 8 layers), plus the head."""
    n = sum(60 if ly.expert else 52 for ly in shape.layers) + 6
    return n, n


def static_frequency(work: Workload) -> dict[int, Any]:
    """Routing counts per MoE layer over a workload's steps (the static policy's placement)."""
    import numpy as np

    ids = np.concatenate([s.ids for s in work.steps])  # (tokens, MoE layers, k)
    return {
        il: np.bincount(ids[:, j][ids[:, j] >= 0], minlength=work.n_expert)
        for j, il in enumerate(work.moe_layers)
    }


def _graph_nodes(trace: Any, shape: ModelShape, notes: list[str]) -> tuple[int, int]:
    """The graph nodes of a prefill and a decode step the trace recorded for this model, else estimated."""
    recorded = trace.meta.get("graph_nodes")
    if recorded and Path(str(trace.meta.get("model", ""))).name == shape.name:
        return (int(recorded[0]), int(recorded[1]))
    nodes = estimate_graph_nodes(shape)
    notes.append(f"graph nodes estimated ({nodes[1]} per decode step)")
    return nodes


def _placement_frequency(
    trace: Any, shape: ModelShape, spec: SimSpec, notes: list[str]
) -> tuple[int, Any, Any]:
    """(the first sequence replayed, the routing counts static places by, the decode counts daop places by):
    the calibration's, else those of the first half of the trace's sequences, and every config replays the
    second half."""
    from ...policies.residency import load_frequency
    from .workload import build_workload

    moe, n_exp, k = shape.moe_layers, shape.n_expert, shape.n_expert_used
    if spec.calibration is not None:
        frequency = load_frequency(spec.calibration, n_expert=n_exp, layers=list(moe))
        decode_frequency = load_frequency(spec.calibration, n_expert=n_exp, layers=list(moe), phase="decode")
        return 0, frequency, decode_frequency
    seqs = sorted({int(x) for x in trace.seq if x >= spec.warmup_seqs})
    first_seq = seqs[len(seqs) // 2] if len(seqs) > 1 else 0
    full = build_workload(trace, moe, n_exp, k, n_ubatch=spec.n_ubatch)
    placed = tuple(s for s in full.steps if s.seq < first_seq) if first_seq else full.steps
    frequency = static_frequency(Workload(placed, full.moe_layers, full.n_expert))
    # DAOP's initial placement: the decode phase's counts (all of them where the trace has no decode)
    decoded = tuple(s for s in placed if s.phase == DECODE) or placed
    decode_frequency = static_frequency(Workload(decoded, full.moe_layers, full.n_expert))
    if first_seq:
        notes.append(
            f"static (daop) placement from the trace's sequences before {first_seq}; "
            "every configuration replays the rest"
        )
    else:
        notes.append("static (daop) placement from the whole trace (one sequence only): optimistic")
    return first_seq, frequency, decode_frequency


def _placement(header: Any, prof: MachineProfile, spec: SimSpec) -> PlacementPlan | None:
    """The model's PlacementPlan at spec's budget, context and KV types on prof's GPU (None: CPU only)."""
    if not (prof.has_gpu and prof.gpu is not None and spec.vram > 0):
        return None
    return plan_placement(
        header,
        budget_request(spec.vram),
        n_ctx=spec.n_ctx,
        device=Device(prof.gpu.name),
        cache_type_k=spec.kv.k,
        cache_type_v=spec.kv.v,
    )


def simulate(
    model: str | Path, trace: Any, prof: MachineProfile, spec: SimSpec, gating: Any = None
) -> SimResult:
    """Replay `trace` (edgemoe.analysis.trace.Trace) on `model`'s shapes through every configuration."""
    from .workload import build_workload

    header = check_gguf(model)
    shape = ModelShape.from_header(header)
    if spec.precalc is not None and not precalc_targets(shape.moe_layers, spec.precalc.first_layer):
        raise EdgeMoeError(
            f"no MoE layer from layer {spec.precalc.first_layer} on follows a MoE layer in "
            f"{shape.name} (MoE layers {list(shape.moe_layers)}): nothing to pre-calculate"
        )
    placement = _placement(header, prof, spec)
    cfgs, slots, n_cpu = plan_configs(shape, prof, spec, placement)
    notes: list[str] = []
    if not cfgs:
        notes.append(f"the dense part and KV cache of {shape.name} do not fit {spec.vram / 2**30:.1f} GiB")
    nodes = _graph_nodes(trace, shape, notes)
    moe, n_exp, k = shape.moe_layers, shape.n_expert, shape.n_expert_used
    first_seq, frequency, decode_frequency = 0, None, None
    if any(c.policy is not None and policy_spec(c.policy).frequency_phase is not None for c in cfgs):
        first_seq, frequency, decode_frequency = _placement_frequency(trace, shape, spec, notes)
    plain = build_workload(
        trace, moe, n_exp, k, n_ubatch=spec.n_ubatch, first_seq=first_seq, verify=spec.verify
    )
    gated = (
        build_workload(
            trace,
            moe,
            n_exp,
            k,
            n_ubatch=spec.n_ubatch,
            gating=gating,
            first_seq=first_seq,
            verify=spec.verify,
        )
        if gating is not None
        else None
    )
    if plain.note:
        notes.append(plain.note)
    on_gpu = prof.has_gpu and spec.vram > 0
    if not on_gpu and prof.kind == "measured" and not prof.cpu.decode_attention:
        notes.append(
            "the profile has no measured decode attention (measured before 2026-11-27): attention priced by its "
            "F16 products, flash attention or not; `edgemoe profile` again adds it"
        )
    results = [
        run_config(
            c,
            gated if c.gated and gated is not None else plain,
            shape,
            prof,
            nodes,
            on_gpu=on_gpu,
            overlap=spec.overlap,
            calibration=spec.calibration,
            frequency=decode_frequency if _phase(c) == "decode" else frequency,
            warmup_seqs=spec.warmup_seqs,
            flash_attn=spec.flash_attn_on,
        )
        for c in cfgs
    ]
    return SimResult(
        model=shape.name,
        profile=prof.name,
        vram=spec.vram,
        slots_per_layer=slots,
        n_cpu_moe=n_cpu,
        workload_note="; ".join(notes),
        configs=results,
    )
