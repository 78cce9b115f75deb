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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...analysis.trace import DECODE, PREFILL
from ...errors import EdgeMoeError
from ...gguf.header import check_gguf
from ...placement.budget import slots_beside_prefill_buffers
from ...placement.planner import Device, PlacementPlan, budget_request
from ...placement.planner import plan as plan_placement
from ...policies.assignment import split_share
from ...policies.copy_queue import load_worker_default
from ...policies.daop import precalc_targets
from ...policies.registry import policy_spec
from ...policies.residency import ResidencyPolicy, make_policy
from .costmodel import LayerCosts, ModelShape, layer_cost_model
from .profile import MachineProfile
from .workload import Step, Workload

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


@dataclass
class _Acc:
    time: float = 0.0
    cpu: float = 0.0
    gpu: float = 0.0
    host: float = 0.0
    pcie: float = 0.0
    hits: int = 0
    misses: int = 0


class _Run:
    """One configuration's replay: clock, copy stream, residency."""

    def __init__(
        self,
        cfg: Config,
        shape: ModelShape,
        prof: MachineProfile,
        nodes: tuple[int, int],
        policy: ResidencyPolicy | None,
        *,
        overlap: bool,
        on_gpu: bool,
    ) -> None:
        # the overlap is edgemoe's (with a cache): stock llama.cpp runs a layer's branches in turn
        self.cfg, self.shape, self.prof, self.overlap = cfg, shape, prof, overlap and cfg.policy is not None
        self.nodes_pp, self.nodes_tg = nodes
        self.policy = policy
        self.cpu = LayerCosts.of(prof.cpu, shape)
        self.gpu = LayerCosts.of(prof.gpu, shape) if on_gpu and prof.gpu is not None else None
        self.clock = 0.0
        self.link_free = 0.0
        self.ready: dict[tuple[int, int], float] = {}  # (layer, expert) -> when its load completes
        self.resident: dict[int, dict[int, int]] = {}  # layer -> expert -> slot
        self.on_gpu = self.gpu is not None
        # the caller sends the loads itself (no load worker on this device): they end the step that queued them
        self.caller_issues = self.on_gpu and prof.gpu is not None and not load_worker_default(prof.gpu.name)
        self.moe_index = {il: j for j, il in enumerate(shape.moe_layers)}  # model layer -> ids' second axis
        self._prefill_issue: float | None = (
            None  # --device-prefill: when the next layer's buffer copy was issued
        )
        # the cached layers whose CPU experts a decode step pre-calculates a layer early (a layer without slots has no
        # cache, and no tables to take the early results with)
        self.precalc_layers = (
            frozenset(
                il
                for il in precalc_targets(shape.moe_layers, cfg.precalc.first_layer)
                if cfg.slots.get(il, 0) > 0
            )
            if cfg.precalc is not None and policy is not None
            else frozenset()
        )
        if policy is not None:
            self._queue(policy.initial_loads(), start=0.0)
            self.clock = self.link_free  # the initial placement is loaded before the first token

    # -- copy stream --------------------------------------------------------------------------
    def _queue(self, loads: list[Any], start: float) -> float:
        t = max(self.link_free, start)
        nbytes = 0
        for ld in loads:
            slots = self.resident.setdefault(ld.layer, {})
            for e in [e for e, s in slots.items() if s == ld.slot or e == ld.expert]:
                del slots[e]
            slots[ld.expert] = ld.slot
            b = self.shape.expert_bytes(ld.layer)
            nbytes += b
            if self.prof.link is not None and self.on_gpu:
                # the cache's loader: chunks from its staging buffers (another engine's: maybe pageable)
                t += b / (self.prof.link.h2d_pageable if self.cfg.pageable_loads else self.prof.link.loads_bw)
            self.ready[(ld.layer, ld.expert)] = t
        self.link_free = t
        return nbytes

    # -- one step ---------------------------------------------------------------------------
    def _nodes(self, s: Step) -> int:
        nodes = self.nodes_pp if s.phase == PREFILL else self.nodes_tg
        moe = len(self.shape.moe_layers)
        if self.cfg.gated and s.phase == DECODE:
            nodes += GATE_NODES_PER_LAYER * moe
        if self.cfg.policy is not None:
            nodes += CACHE_NODES_PER_LAYER * moe
        if s.phase == DECODE and s.n_tokens == 1:
            nodes += PRECALC_NODES_PER_LAYER * len(self.precalc_layers)
        if self.cfg.decode_split and s.n_tokens < OFFLOAD_MIN_TOKENS:
            nodes += SPLIT_NODES_PER_LAYER * moe
        return nodes

    def step(self, s: Step, acc: _Acc) -> float:
        """One ubatch or decode token. On a GPU a layer's kernels cannot run faster than the host launches
        them (`node_s` each): its GPU time is at least its share of the graph's nodes times the launch cost."""
        start = self.clock
        t = start
        n = s.n_tokens
        self._prefill_issue = None  # the first cached layer's copy is queued when the step starts
        main = self.gpu or self.cpu
        pending: list[Any] = []
        nodes = self._nodes(s)
        launch = (
            nodes / max(1, len(self.shape.layers)) * self.prof.gpu.node_s
            if self.gpu and self.prof.gpu
            else 0.0
        )
        n_cpu_splits = 0
        for ly in self.shape.layers:
            d = main.dense(ly.il, n) + main.attention(ly.il, n, s.kv_len)
            self._busy(acc, d, gpu=self.on_gpu)
            j = self.moe_index.get(ly.il)
            if not self.on_gpu:
                c = self.cpu.experts(ly.il, s.counts(j)) if j is not None else 0.0
                acc.cpu += c
                t += d + c
                continue
            g, c, wait, early = (
                (0.0, 0.0, 0.0, 0.0)
                if j is None
                else self._moe_layer(ly.il, s.ids[:, j, :], s.counts(j), s, t, acc, pending, dense_s=d)
            )
            n_cpu_splits += bool(c) + bool(early)
            if self.cfg.host_routed and ly.il in self.cfg.slots and self.prof.link is not None:
                wait += self.prof.link.latency_s  # the routing read back before the layer's experts
                acc.host += self.prof.link.latency_s
            gpu_side = max(d + g, launch)
            acc.host += gpu_side - (d + g)  # the GPU idles while the host launches the layer's kernels
            # overlapped, the CPU's experts start once the layer's dense part (attention, the router) is done; the
            # pre-calculated ones start with the layer, and the rest once both are done
            if self.overlap or self.cfg.assign and n > 1:
                t += max(wait + gpu_side, max(d, early) + c)
            else:
                t += wait + gpu_side + early + c
        h = main.head(1)  # llama.cpp computes logits for the last token of a ubatch (and each decode token)
        t += h
        self._busy(acc, h, gpu=self.on_gpu)
        host = self.prof.host.call_s + self.prof.host.vocab_s * self.shape.n_vocab
        if self.on_gpu:
            host += n_cpu_splits * CPU_NODES_PER_SPLIT * self.prof.cpu.node_s
        else:
            per_node = self.prof.cpu.node_s + (n - 1) * self.shape.info.n_embd * self.prof.host.node_elem_s
            host += nodes * per_node
        t += host
        acc.host += host
        if pending:
            acc.pcie += self._queue(pending, start=t)
            if self.caller_issues:
                acc.host += self.link_free - t
                t = self.link_free
        acc.time += t - start
        self.clock = t
        return t - start

    def _busy(self, acc: _Acc, dt: float, *, gpu: bool) -> None:
        if gpu:
            acc.gpu += dt
        else:
            acc.cpu += dt

    def _moe_layer(
        self,
        il: int,
        ids: Any,
        counts: dict[int, int],
        s: Step,
        t: float,
        acc: _Acc,
        pending: list[Any],
        dense_s: float = 0.0,
    ) -> tuple[float, float, float, float]:
        """(GPU time, CPU time with its hand-offs, wait for slots still loading, CPU time of the experts
        pre-calculated for this layer with its hand-off) of one MoE layer's experts."""
        assert self.gpu is not None and self.prof.link is not None
        link = self.prof.link
        if il in self.cfg.gpu_expert_layers:
            g = self.gpu.experts(il, counts)
            acc.gpu += g
            return g, 0.0, 0.0, 0.0
        if self.policy is not None:
            loads = self.policy.on_route(il, ids)
            if self.policy.blocking and loads:
                acc.pcie += self._queue(loads, start=t)
            elif loads:
                pending += loads
            resident = self.resident.get(il, {})
            gpu_e = {e: c for e, c in counts.items() if e in resident}
            hits = sum(gpu_e.values())
            acc.hits += hits
            acc.misses += sum(counts.values()) - hits
        else:
            gpu_e = {}
        cpu_e = {e: c for e, c in counts.items() if e not in gpu_e}
        wait = max([self.ready.get((il, e), 0.0) for e in gpu_e] + [t]) - t  # slots still loading
        if self.cfg.assign is not None and s.n_tokens > 1 and counts:
            g, c = self._assigned(il, counts, set(gpu_e), acc)
            return g, c, wait, 0.0
        if self.cfg.device_prefill and s.n_tokens >= OFFLOAD_MIN_TOKENS and counts:
            return self._device_prefill(il, counts, t, dense_s, acc) + (wait, 0.0)
        g = self.gpu.experts(il, gpu_e)
        c = early = 0.0
        if (
            cpu_e
            and s.n_tokens >= OFFLOAD_MIN_TOKENS
            and self.prof.gpu is not None
            and self.prof.gpu.op_offload
        ):
            nbytes = self.shape.expert_bytes(il) * len(cpu_e)  # op offload copies the used experts
            acc.pcie += nbytes
            g += nbytes / link.h2d_pageable + self.gpu.experts(il, cpu_e)
        elif cpu_e and s.n_tokens == 1 and il in self.precalc_layers:
            early, c = self._precalc(il, cpu_e, acc)
        elif cpu_e and self.cfg.decode_split:
            gs, c = self._split(il, cpu_e, acc, gpu_busy=g)
            g += gs
        elif cpu_e:
            cpu = self.cpu.experts(il, cpu_e)
            acc.cpu += cpu
            c = 2 * link.latency_s + cpu
        acc.gpu += g
        return g, c, wait, early

    def _split(self, il: int, cpu_e: dict[int, int], acc: _Acc, gpu_busy: float) -> tuple[float, float]:
        """A step's experts outside the slots (below op offload's batch size) by the decode-miss cost model
        (policies.assignment.decode_miss_costs, for the layer's misses together): on the CPU; copied whole to the
        GPU and computed there (into scratch memory: the slots do not change); or split by rows (split_share), the
        CPU computing a share f of each one's rows from host memory while the link copies the other rows to the
        GPU, which computes them after the layer's resident experts (gpu_busy); whichever ends first. The copies go through the loader's staging buffers but
        not on the cache's copy stream. Returns (the GPU side's time, the CPU side's with its hand-offs)."""
        assert self.gpu is not None and self.prof.link is not None
        hand = 2 * self.prof.link.latency_s
        nbytes = self.shape.expert_bytes(il) * len(cpu_e)
        cpu, gpu = self.cpu.experts(il, cpu_e), self.gpu.experts(il, cpu_e)
        wait = nbytes / self.prof.link.loads_bw + gpu
        f = split_share(cpu, wait, hand, gpu_busy)
        if not 0.0 < f < 1.0:
            f = (
                1.0 if hand + cpu <= gpu_busy + wait else 0.0
            )  # one side alone: the CPU, or the GPU after the copy
        acc.cpu += f * cpu
        acc.gpu += (1.0 - f) * gpu
        acc.pcie += (1.0 - f) * nbytes
        return (1.0 - f) * wait, (hand + f * cpu if f > 0.0 else 0.0)

    def _precalc(self, il: int, cpu_e: dict[int, int], acc: _Acc) -> tuple[float, float]:
        """A decode step's CPU experts of a pre-calculated layer (PrecalcSpec): (the early split's time with the
        hand-off of its input, the late split's with the hand-offs of the layer's CPU branch). Each split pays the
        expert products' fixed cost."""
        assert self.prof.link is not None and self.cfg.precalc is not None
        pc, lat = self.cfg.precalc, self.prof.link.latency_s
        work = sum(self.cpu.expert(il, c) for c in cpu_e.values())
        fixed = self.cpu.expert_fixed(il, max(cpu_e.values()))
        early = fixed + work * (pc.recall + pc.wasted)
        late = fixed + work * (1.0 - pc.recall)
        acc.cpu += early + late
        return lat + early, 2 * lat + late

    def _device_prefill(
        self, il: int, counts: dict[int, int], t: float, dense_s: float, acc: _Acc
    ) -> tuple[float, float]:
        """A prefill ubatch's layer with --device-prefill: every routed expert on the GPU; the experts outside the
        slots were copied into the layer's prefill buffer on the copy stream from the previous cached layer's
        routing (the first layer's from the step's start), so the layer's experts wait for the end of that copy.
        Returns (GPU time including that wait, CPU time 0)."""
        assert self.gpu is not None and self.prof.link is not None
        outside = self.shape.info.n_expert - len(self.resident.get(il, {}))
        nbytes = self.shape.expert_bytes(il) * outside
        # issued at the previous cached layer's routing callback (after its dense part), or when the step began
        issued = self._prefill_issue if self._prefill_issue is not None else t
        done = max(self.link_free, issued) + nbytes / self.prof.link.loads_bw
        self.link_free = done
        acc.pcie += nbytes
        self._prefill_issue = t + dense_s  # this layer's routing: the next layer's copy starts then
        g = self.gpu.experts(il, counts)
        acc.gpu += g
        return max(0.0, done - (t + dense_s)) + g, 0.0

    def _assigned(
        self, il: int, counts: dict[int, int], resident: set[int], acc: _Acc
    ) -> tuple[float, float]:
        """A prefill ubatch's experts split between the CPU and the GPU (copying some) by an assigner: (GPU time
        with the copies, CPU time with the hand-off); the two sides run at once."""
        from ...policies.assignment import make_assigner

        assert self.gpu is not None and self.prof.link is not None and self.cfg.assign is not None
        cost = layer_cost_model(self.cpu, self.gpu, self.prof.link, il, handoff_tokens=max(counts.values()))
        a = make_assigner(self.cfg.assign)(counts, resident, cost)
        acc.cpu += a.t_cpu
        acc.gpu += a.t_gpu - a.t_transfer
        acc.pcie += len(a.load) * self.shape.expert_bytes(il)
        return a.t_gpu, a.t_cpu


def _phase(cfg: Config) -> str | None:
    """The phase of the router counts cfg's policy places by (static: "all", daop: "decode"), or None."""
    return None if cfg.policy is None else policy_spec(cfg.policy).frequency_phase


@dataclass(frozen=True)
class SimSpec:
    vram: int  # bytes of GPU memory the model may use (0: CPU only)
    n_ctx: int = 4096
    n_ubatch: int = 512
    policies: tuple[str, ...] = ("lru", "static")
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
    prefill_slots = slots_beside_prefill_buffers(shape.info, per_layer, spec.vram, placement.n_ctx)
    n_cpu = placement.n_cpu_moe
    cfgs = [Config("stock-ot-exps-cpu", "stock")]
    if n_cpu is not None and n_cpu < len(moe):
        cfgs.append(Config(f"stock-n-cpu-moe-{n_cpu}", "stock", gpu_expert_layers=frozenset(moe[n_cpu:])))
    for pol in spec.policies:
        for gated in (False, True) if spec.gated else (False,):
            cfgs.append(
                Config(
                    f"edgemoe-{pol}" + ("-gated" if gated else ""),
                    "edgemoe",
                    policy=pol,
                    slots=per_layer,
                    gated=gated,
                    blocking=spec.blocking,
                )
            )
        if spec.assign is not None:
            cfgs.append(
                Config(
                    f"edgemoe-{pol}-{spec.assign}-assign",
                    "edgemoe",
                    policy=pol,
                    slots=per_layer,
                    blocking=spec.blocking,
                    assign=spec.assign,
                )
            )
        if spec.device_prefill:
            cfgs.append(
                Config(
                    f"edgemoe-{pol}-device-prefill",
                    "edgemoe",
                    policy=pol,
                    slots=prefill_slots,
                    blocking=spec.blocking,
                    device_prefill=True,
                )
            )
        if spec.precalc is not None:
            cfgs.append(
                Config(
                    f"edgemoe-{pol}-precalc",
                    "edgemoe",
                    policy=pol,
                    slots=per_layer,
                    blocking=spec.blocking,
                    precalc=spec.precalc,
                )
            )
        if spec.decode_split:
            cfgs.append(
                Config(
                    f"edgemoe-{pol}-decode-split",
                    "edgemoe",
                    policy=pol,
                    slots=per_layer,
                    blocking=spec.blocking,
                    decode_split=True,
                )
            )
    return cfgs, slots, n_cpu


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
) -> ConfigResult:
    """Replay the workload's steps in order through one configuration. `policy`: a fresh residency policy
    object to replay for cfg.policy instead of one built by name (e.g. with frequencies of another trace).
    Sequences below `warmup_seqs` run (their loads, the policy's state) but are not counted."""
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
    run = _Run(cfg, shape, prof, nodes, policy, overlap=overlap, on_gpu=on_gpu)
    pre, dec = _Acc(), _Acc()
    seq_pre: dict[int, float] = {}
    for s in work.steps:
        if s.seq < warmup_seqs:
            run.step(s, _Acc())
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


def simulate(
    model: str | Path, trace: Any, prof: MachineProfile, spec: SimSpec, gating: Any = None
) -> SimResult:
    """Replay `trace` (edgemoe.analysis.trace.Trace) on `model`'s shapes through every configuration."""
    from ...policies.residency import load_frequency
    from .workload import build_workload

    header = check_gguf(model)
    shape = ModelShape.from_header(header)
    if spec.precalc is not None and not precalc_targets(shape.moe_layers, spec.precalc.first_layer):
        raise EdgeMoeError(
            f"no MoE layer from layer {spec.precalc.first_layer} on follows a MoE layer in "
            f"{shape.name} (MoE layers {list(shape.moe_layers)}): nothing to pre-calculate"
        )
    placement = None
    if prof.has_gpu and prof.gpu is not None and spec.vram > 0:
        placement = plan_placement(
            header, budget_request(spec.vram), n_ctx=spec.n_ctx, device=Device(prof.gpu.name)
        )
    cfgs, slots, n_cpu = plan_configs(shape, prof, spec, placement)
    notes = []
    if not cfgs:
        notes.append(f"the dense part and KV cache of {shape.name} do not fit {spec.vram / 2**30:.1f} GiB")
    recorded = trace.meta.get("graph_nodes")
    if recorded and Path(str(trace.meta.get("model", ""))).name == shape.name:
        nodes = (int(recorded[0]), int(recorded[1]))
    else:
        nodes = estimate_graph_nodes(shape)
        notes.append(f"graph nodes estimated ({nodes[1]} per decode step)")
    moe, n_exp, k = shape.moe_layers, shape.n_expert, shape.n_expert_used
    first_seq, frequency, decode_frequency = 0, None, None
    if any(c.policy is not None and policy_spec(c.policy).frequency_phase is not None for c in cfgs):
        if spec.calibration is not None:
            frequency = load_frequency(spec.calibration, n_expert=n_exp, layers=list(moe))
            decode_frequency = load_frequency(
                spec.calibration, n_expert=n_exp, layers=list(moe), phase="decode"
            )
        else:  # place by the first half of the trace's sequences, replay the second half (for every config)
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
    plain = build_workload(trace, moe, n_exp, k, n_ubatch=spec.n_ubatch, first_seq=first_seq)
    gated = (
        build_workload(trace, moe, n_exp, k, n_ubatch=spec.n_ubatch, gating=gating, first_seq=first_seq)
        if gating is not None
        else None
    )
    if plain.note:
        notes.append(plain.note)
    on_gpu = prof.has_gpu and spec.vram > 0
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
