"""The prefill ubatch the plan picks for a long prompt, and what a prompt then costs before its first
token, for stock llama.cpp and for edgemoe with --device-prefill at the same VRAM budget.

A prefill ubatch pays each copy of experts once, whatever its size: edgemoe's --device-prefill copies every
layer's experts outside the slots per ubatch, stock's op offload the experts the ubatch uses in each layer kept on
the CPU. More tokens per ubatch spread those bytes over more tokens, and cost VRAM: llama.cpp's compute buffer
grows with the ubatch (edgemoe.plan.reserve.compute_buffer_bytes; with flash attention mostly the logits' rows),
which comes out of edgemoe's expert slots and out of the layers stock keeps on the GPU (a higher --n-cpu-moe).
For each candidate ubatch (UBATCHES, at most the prompt and the context) each side is placed at the budget with
that buffer and the prompt is replayed through the simulator (edgemoe.perf.model.sim); each side gets its
fastest ubatch, so stock is compared at its best -ub, not at 512. The prompt's routing is the trace's prefill
tokens in order, repeated (workload.prompt_workload). Every figure is a projection.

edgemoe is projected twice: with the two prefill buffers beside the slots, and with them over the slots of the
last cached layers while the prompt is prefilled (--device-prefill-borrow): the slots decode keeps are then those
of a budget without the buffers, and the lent layers run the prompt with no slot (every routed expert copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...analysis.routing_profile import routing_for_model
from ...analysis.trace import Trace
from ...gguf.header import GgufHeader
from ...gguf.kv_types import F16_KV, KvTypes
from ...plan.budget import best_n_cpu_moe, borrow_fits, engine_ctx, lent_layers, slot_budget
from ...plan.reserve import PLAN_UBATCH, Reserve, compute_buffer_bytes, reserve_bytes, ubatch_reserve_bytes
from ...plan.ubatch import PrefillQuestion, UbatchPick
from .costmodel import ModelShape
from .prefill_decode import DecodeAfterPrompt, SideSlots, decode_after_prompt
from .profile import MachineProfile
from .prompt_replay import replay_prompt
from .sim.config import OFFLOAD_MIN_TOKENS, Config
from .simulate import estimate_graph_nodes, static_frequency
from .workload import Workload, build_workload, prompt_workload

UBATCHES = (512, 1024, 2048, 4096)  # the ubatches the plan chooses among (llama.cpp's -ub)
PROMPTS = (2048, 8192, 32768)  # the prompt lengths `edgemoe plan` projects by default
# an engine's larger compute buffer stays allocated and takes expert slots from decode for good: it opens at the
# smallest ubatch within this share of the fastest one's projected prefill (settled)
NEAR_FASTEST = 0.05


@dataclass(frozen=True)
class PrefillSpec:
    vram: int  # the GPU budget in bytes
    n_ctx: int  # the plan's context: a prompt gets at least its own length (engine_ctx rounds it)
    policy: str = "static"  # edgemoe's cache policy beside --device-prefill
    flash_attn: bool = True  # "auto" resolves to on with CUDA: the compute buffer then grows far less
    kv: KvTypes = F16_KV
    ubatches: tuple[int, ...] = UBATCHES


@dataclass(frozen=True)
class UbatchOption:
    """One side's prefill of a prompt at one ubatch."""

    n_ubatch: int
    compute_buffer_bytes: int  # llama.cpp's compute buffer at this ubatch (estimate)
    extra_reserve_bytes: int  # beyond the plan's reserve: out of the slots, or stock's GPU layers
    slots_per_layer: int | None  # edgemoe: its expert slots beside the buffers, decode's (None: stock)
    n_cpu_moe: int | None  # stock: its --n-cpu-moe beside the buffer (None: edgemoe)
    prefill_tps: float
    ttft_s: float  # the whole prompt's prefill: the time to the first token
    bound: str  # the resource busiest during the prefill: "copy", "gpu", "cpu" or "host"
    lent_layers: int = 0  # borrowing: the last cached layers whose slots hold the prefill buffers meanwhile


@dataclass(frozen=True)
class PrefillChoice:
    """One side's ubatch for a prompt: the fastest of its options, and why."""

    config: str  # "stock" or the edgemoe configuration's name
    kind: str  # "stock" | "edgemoe"
    best: UbatchOption
    options: tuple[UbatchOption, ...]  # every candidate that fits, smallest ubatch first
    reason: str
    borrow: bool = False  # edgemoe's prefill buffers over the slots of its last cached layers


@dataclass(frozen=True)
class PrefillProjection:
    prompt_tokens: int
    n_ctx: int  # the context the prompt is placed with (its KV cache comes out of the budget)
    flash_attn: bool
    choices: tuple[PrefillChoice, ...]  # stock first (absent where its dense part does not fit), then edgemoe
    notes: tuple[str, ...] = field(default=())
    # the GPU alone, every expert resident (a card that held the whole model), at its fastest candidate ubatch:
    # no placement of the experts in the GPU's memory prefills faster on this profile (0.0: not projected)
    ceiling_tps: float = 0.0
    ceiling_ubatch: int = 0
    # decode's first tokens after the prompt, the buffers beside the slots and borrowing (None: not projected)
    decode_after: DecodeAfterPrompt | None = None


class PrefillPlanner:
    """Projects prompts of one model on one machine profile with one routing trace; the static placement's routing
    counts are taken once, from the whole trace."""

    def __init__(self, shape: ModelShape, trace: Trace, prof: MachineProfile, spec: PrefillSpec) -> None:
        self.shape, self.trace, self.prof, self.spec = shape, trace, prof, spec
        moe, k = shape.moe_layers, shape.n_expert_used
        whole: Workload = build_workload(trace, moe, shape.n_expert, k, n_ubatch=PLAN_UBATCH)
        self.frequency = static_frequency(whole)
        self.nodes = estimate_graph_nodes(shape)

    def project(self, n_tokens: int) -> PrefillProjection:
        """Both sides' fastest ubatch for a prompt of `n_tokens` tokens."""
        info, spec = self.shape.info, self.spec
        ctx = engine_ctx(max(spec.n_ctx, n_tokens), info.n_ctx_train)
        cands = [u for u in spec.ubatches if u <= min(n_tokens, ctx)] or [PLAN_UBATCH]
        stock: list[UbatchOption] = []
        ours: list[UbatchOption] = []
        lent: list[UbatchOption] = []
        note = ""
        ceiling = (0.0, 0)
        for u in cands:
            work = prompt_workload(
                self.trace, self.shape.moe_layers, self.shape.n_expert, self.shape.n_expert_used,
                n_tokens=n_tokens, n_ubatch=u,
            )  # fmt: skip
            note = note or work.note
            ceiling = max(ceiling, (self._resident(work), u))
            if (opt := self._stock(work, ctx, u)) is not None:
                stock.append(opt)
            if (opt := self._edgemoe(work, ctx, u)) is not None:
                ours.append(opt)
            if (opt := self._edgemoe(work, ctx, u, borrow=True)) is not None:
                lent.append(opt)
        name = f"edgemoe-{spec.policy}-device-prefill"
        choices = [
            _choose(name, kind, opts, borrow=borrow)
            for name, kind, opts, borrow in (
                ("stock", "stock", stock, False),
                (name, "edgemoe", ours, False),
                (name + "-borrow", "edgemoe", lent, True),
            )
            if opts
        ]
        notes = (note,) if note else ()
        after = self._decode_after(n_tokens, choices)
        return PrefillProjection(n_tokens, ctx, spec.flash_attn, tuple(choices), notes, *ceiling, after)

    def _decode_after(self, n_tokens: int, choices: Sequence[PrefillChoice]) -> DecodeAfterPrompt | None:
        """Decode after the prompt on each edgemoe side, at the ubatch an engine opens with."""
        by = {c.borrow: settled(c) for c in choices if c.kind == "edgemoe"}
        if set(by) != {False, True}:
            return None
        beside, lent = (
            SideSlots(o.n_ubatch, o.slots_per_layer or 0, o.lent_layers) for o in (by[False], by[True])
        )
        return decode_after_prompt(
            self.shape, self.trace, self.prof, policy=self.spec.policy, frequency=self.frequency,
            nodes=self.nodes, prompt_tokens=n_tokens, beside=beside, borrow=lent,
        )  # fmt: skip

    def _resident(self, work: Workload) -> float:
        """Prefill tok/s with every expert on the GPU and nothing copied, whatever the budget."""
        cfg = Config("every-expert-resident", "stock", gpu_expert_layers=frozenset(self.shape.moe_layers))
        return self._replay(cfg, work)[0]

    def _reserve(self, ctx: int, u: int, *, device_prefill: bool = False) -> tuple[int, int, int]:
        """(the compute buffer at ubatch u, what it needs beyond the plan's reserve at 512, the whole reserve)."""
        info, fa = self.shape.info, self.spec.flash_attn
        buf = compute_buffer_bytes(info, ctx, u, flash_attn=fa)
        what = Reserve(n_ubatch=u, flash_attn=fa, kv=self.spec.kv, device_prefill=device_prefill)
        return buf, ubatch_reserve_bytes(info, ctx, u, flash_attn=fa), reserve_bytes(info, ctx, what)

    def _stock(self, work: Workload, ctx: int, u: int) -> UbatchOption | None:
        """Stock llama.cpp at -ub u: its best --n-cpu-moe beside the larger buffer, the CPU's layers by op offload."""
        buf, extra, reserve = self._reserve(ctx, u)
        n = best_n_cpu_moe(self.shape.info, self.spec.vram, ctx, self.spec.kv, reserve_bytes=reserve)
        if n is None:
            return None
        moe = self.shape.moe_layers
        cfg = Config(f"stock-n-cpu-moe-{n}", "stock", gpu_expert_layers=frozenset(moe[n:]))
        tps, ttft, bound = self._replay(cfg, work)
        return UbatchOption(u, buf, extra, None, n, tps, ttft, bound)

    def _edgemoe(self, work: Workload, ctx: int, u: int, *, borrow: bool = False) -> UbatchOption | None:
        """edgemoe with --device-prefill at ubatch u: the slots the budget leaves beside the buffers; borrowing,
        those of a budget without them, the last layers' lent to them during the prompt (None: they do not fit)."""
        info, spec = self.shape.info, self.spec
        buf, extra, reserve = self._reserve(ctx, u, device_prefill=not borrow)
        budget = slot_budget(info, spec.vram, n_ctx=ctx, reserve_bytes=reserve, kv=spec.kv)
        n = budget.experts_per_layer
        if not budget.dense_fits or (borrow and not borrow_fits(info, n)):
            return None
        moe = self.shape.moe_layers
        lent = lent_layers(info, n) if borrow else 0
        slots = {il: 0 if i >= len(moe) - lent else n for i, il in enumerate(moe)}
        name = f"edgemoe-{spec.policy}-device-prefill"
        cfg = Config(name, "edgemoe", policy=spec.policy, slots=slots, device_prefill=True)
        tps, ttft, bound = self._replay(cfg, work)
        return UbatchOption(u, buf, extra, n, None, tps, ttft, bound, lent_layers=lent)

    def _replay(self, cfg: Config, work: Workload) -> tuple[float, float, str]:
        return replay_prompt(self.shape, self.prof, cfg, work, nodes=self.nodes, frequency=self.frequency)


def _choose(name: str, kind: str, opts: Sequence[UbatchOption], *, borrow: bool = False) -> PrefillChoice:
    best = max(opts, key=lambda o: o.prefill_tps)
    each = ", ".join(
        f"-ub {o.n_ubatch}: {o.prefill_tps:.0f} tok/s ({o.bound}-bound, " + _placed(o) + ")" for o in opts
    )
    reason = f"-ub {best.n_ubatch} is the fastest that fits: {each}"
    return PrefillChoice(name, kind, best, tuple(opts), reason, borrow)


def settled(choice: PrefillChoice) -> UbatchOption:
    """The ubatch an engine opens with: the smallest of the choice's whose projected prefill is within
    NEAR_FASTEST of its fastest (ProfilePricing, bench's +device prefill rows)."""
    floor = (1 - NEAR_FASTEST) * choice.best.prefill_tps
    return min((o for o in choice.options if o.prefill_tps >= floor), key=lambda o: o.n_ubatch)


def _placed(o: UbatchOption) -> str:
    if o.slots_per_layer is None:
        return f"--n-cpu-moe {o.n_cpu_moe}"
    return f"{o.slots_per_layer} slots" + (
        f", the last {o.lent_layers} layers' lent" if o.lent_layers else ""
    )


def project_prompts(
    shape: ModelShape, trace: Trace, prof: MachineProfile, spec: PrefillSpec, prompts: Sequence[int] = PROMPTS
) -> tuple[list[PrefillProjection], list[str]]:
    """The projections of each prompt length the model's training context holds, and notes on those it skips."""
    n_train = shape.info.n_ctx_train
    fit = [n for n in prompts if not n_train or n <= n_train]
    notes = [
        f"a {n}-token prompt is longer than the model's training context ({n_train}): not projected"
        for n in prompts
        if n not in fit
    ]
    if not fit:
        return [], notes
    notes.append(
        f"prefill: {spec.policy} placed by the whole trace's routing counts; each side at its fastest ubatch of "
        + ", ".join(str(u) for u in spec.ubatches)
    )
    planner = PrefillPlanner(shape, trace, prof, spec)
    return [planner.project(n) for n in fit], notes


def format_prefill(projections: Sequence[PrefillProjection]) -> list[str]:
    """Lines for `edgemoe plan`: per prompt, each side's ubatch, prefill tok/s and time to first token."""
    lines = []
    for p in projections:
        fa = "flash attention" if p.flash_attn else "no flash attention"
        lines.append(
            f"  prefill of a {p.prompt_tokens}-token prompt ({p.n_ctx}-token context, {fa}), PROJECTED:"
        )
        for c in p.choices:
            b = c.best
            lines.append(
                f"    {c.config} at -ub {b.n_ubatch} ({_placed(b)}): {b.prefill_tps:.0f} tok/s, "
                f"time to first token {b.ttft_s:.1f} s, {b.bound}-bound"
            )
            lines.append(f"      why: {c.reason}")
        if (d := p.decode_after) is not None:
            lines.append(
                f"    decode of the first {d.decode_tokens} tokens after it: {d.beside_tps:.1f} tok/s with "
                f"{d.beside.slots_per_layer} slots beside the buffers (-ub {d.beside.n_ubatch}), {d.borrow_tps:.1f} "
                f"borrowing ({d.borrow.slots_per_layer} slots at -ub {d.borrow.n_ubatch}, {d.borrow.lent_layers} "
                f"layers refilled: {d.refill_bytes / 2**20:.0f} MiB, {1e3 * d.refill_s:.0f} ms of copies), "
                f"{d.ratio:.3f}x"
            )
        if p.ceiling_tps:
            lines.append(
                f"    the GPU alone, every expert resident, at -ub {p.ceiling_ubatch}: {p.ceiling_tps:.0f} tok/s "
                "(no placement of the experts in its memory prefills faster on this profile)"
            )
    return lines


@dataclass(frozen=True)
class LongPromptRun:
    """How to run the longest projected prompt as the plan's edgemoe side does: device prefill from the
    simulator's threshold, at the ubatch an engine opens with (`settled`), borrowing the slots where that keeps
    prefill within 3% and decode's first tokens no slower."""

    n_ctx: int
    prompt_tokens: int
    n_ubatch: int
    device_prefill_min_tokens: int
    borrow: bool
    prefill_tps: float
    stock_tps: float  # stock's best for the same prompt
    stock_ubatch: int
    more_slots: int = 0  # borrowing: decode's slots per layer beyond the other side's
    decode_ratio: float = 0.0  # borrowing: decode's first tokens over the other side's (0.0: not projected)


def long_prompt_run(projections: Sequence[PrefillProjection]) -> LongPromptRun | None:
    """The run for the longest projected prompt; None where stock's best prefills it at least as fast."""
    if not projections:
        return None
    p = max(projections, key=lambda x: x.prompt_tokens)
    by = {(c.kind, c.borrow): c for c in p.choices}
    stock, ours, lent = by.get(("stock", False)), by.get(("edgemoe", False)), by.get(("edgemoe", True))
    if stock is None or ours is None or ours.best.prefill_tps <= stock.best.prefill_tps:
        return None
    d = p.decode_after
    borrow = (
        lent is not None
        and lent.best.prefill_tps >= 0.97 * ours.best.prefill_tps
        and (d is None or d.ratio >= 1.0)
    )
    o = settled(lent if borrow and lent is not None else ours)
    more, ratio = (d.borrow.slots_per_layer - d.beside.slots_per_layer, d.ratio) if borrow and d else (0, 0.0)
    return LongPromptRun(
        p.n_ctx, p.prompt_tokens, o.n_ubatch, OFFLOAD_MIN_TOKENS, borrow, o.prefill_tps,
        stock.best.prefill_tps, stock.best.n_ubatch, more, ratio,
    )  # fmt: skip


class ProfilePricing:
    """Device prefill priced on a machine profile (edgemoe.plan.ubatch.PrefillPricing): edgemoe's side of the
    prefill plan at its settled ubatch, the prompt's routing drawn from the bundled routing profile of the model's
    shape. plan() asks it; open_engine and bench hand it over."""

    def __init__(self, prof: MachineProfile, *, prompt_tokens: int | None = None) -> None:
        self.prof = prof
        self.prompt_tokens = prompt_tokens  # the prompt to plan for (None: the plan's question's)
        self._memo: dict[tuple[str, PrefillQuestion], PrefillProjection] = {}

    @property
    def name(self) -> str:
        return self.prof.name

    def pick_ubatch(self, header: GgufHeader, question: PrefillQuestion) -> UbatchPick | None:
        choice = self._choice(header, question, "edgemoe", question.borrow)
        if choice is None:
            return None
        u = min(settled(choice).n_ubatch, question.n_ctx)
        prompt = min(self.prompt_tokens, question.n_ctx) if self.prompt_tokens else question.prompt_tokens
        why = (
            f"{choice.config} on {self.prof.name}, a {prompt}-token prompt: -ub {u} is the smallest "
            f"within {NEAR_FASTEST:.0%} of the fastest projected prefill ({choice.reason})"
        )
        return UbatchPick(u, why)

    def stock_ubatch(self, header: GgufHeader, question: PrefillQuestion) -> UbatchOption | None:
        """Stock llama.cpp's fastest -ub for the prompt, with its --n-cpu-moe beside that buffer (None: it does
        not fit)."""
        choice = self._choice(header, question, "stock", False)
        return choice.best if choice is not None else None

    def _choice(
        self, header: GgufHeader, q: PrefillQuestion, kind: str, borrow: bool
    ) -> PrefillChoice | None:
        if self.prompt_tokens is not None:
            q = replace(q, prompt_tokens=min(self.prompt_tokens, q.n_ctx))
        key = (str(header.path), replace(q, borrow=False))  # one projection has both sides
        if key not in self._memo:
            shape = ModelShape.from_header(header)
            info = shape.info
            trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
            spec = PrefillSpec(q.vram, q.n_ctx, flash_attn=q.flash_attn, kv=q.kv)
            self._memo[key] = PrefillPlanner(shape, trace, self.prof, spec).project(q.prompt_tokens)
        choices = self._memo[key].choices
        return next((c for c in choices if c.kind == kind and c.borrow == borrow), None)
