"""`edgemoe plan`: what a VRAM budget holds for a model, how its expert slots spread over the MoE layers
(equal, and AdapMoE's DP allocation from the calibration's routing trace), the hit rate each policy is
expected to reach, and the speeds the performance model projects.

Hit rates and speeds replay a routing trace: `--trace` (e.g. `edgemoe trace --heldout` or `edgemoe
trace-synth`), else a bundled routing profile named by `--routing`, else the calibration's routing
trace, which is the data the static placement and the DP allocation were fitted on (so their figures
on it are in-sample; the plan says so), else the bundled routing profile of a real model that
matches the model's expert count and top-k (or the nearest one), drawn at the model's shape
(edgemoe.analysis.routing_profile). The plan names the routing it used (`routing`,
`routing_profile`).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...analysis.routing_profile import routing_for_model
from ...analysis.trace import Trace
from ...calibration.slot_alloc import RoutingTrace, allocate_slots
from ...errors import EdgeMoeError
from ...gguf.header import check_gguf
from ...gguf.info import ModelInfo, model_info, size_arg
from ...gguf.kv_types import KvCacheType, KvTypes
from ...plan.budget import SlotBudget
from ...plan.context import ContextTable, format_context_table
from ...plan.planner import PlacementPlan, budget_request
from ...plan.planner import plan as plan_placement
from ...policies.registry import policy_spec, projected_policies
from .context_speeds import project_context_table
from .costmodel import ModelShape
from .prefill_plan import (
    PROMPTS,
    LongPromptRun,
    PrefillProjection,
    PrefillSpec,
    format_prefill,
    long_prompt_run,
    project_prompts,
)
from .profile import MachineProfile
from .simulate import SimSpec, simulate


@dataclass
class Layouts:
    model: str
    budget_bytes: int
    n_ctx: int
    fits: dict[str, int]  # dense, kv_cache, reserve, experts (bytes)
    slot_bytes: int  # one expert in every MoE layer
    slots_per_layer: dict[
        str, list[int] | None
    ]  # equal / dp -> one entry per MoE layer (None: not available)
    n_cpu_moe: int | None  # stock llama.cpp's best --n-cpu-moe at this budget
    routing: str = ""  # where the expected figures' routing comes from
    routing_profile: str | None = (
        None  # the bundled routing profile the trace was drawn from (None: recorded)
    )
    profile: str = ""
    expected: list[dict[str, Any]] = field(
        default_factory=list
    )  # per configuration: hit rate, projected speeds
    # the fastest projected decode among edgemoe's rows against the best stock row, and the command that runs it
    # (None without projected speeds)
    suggestion: dict[str, Any] | None = None
    # with a GPU profile, where edgemoe prefills the longest projected prompt faster than stock: the command that
    # runs it so (the suggestion's policy, device prefill at the settled ubatch, borrowing where it pays) and why
    long_prompt: dict[str, Any] | None = None
    # with a GPU profile: each prompt's prefill, stock and edgemoe at their fastest ubatch (prefill_plan.py)
    prefill: list[PrefillProjection] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # context length x KV type -> expert slots at this budget (and projected speeds with a GPU profile)
    contexts: ContextTable | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field, the context table as `context_table`, a list of row objects (none: [])."""
        d = asdict(self)
        del d["contexts"]
        d["context_table"] = self.contexts.to_rows() if self.contexts is not None else []
        d["context_projected"] = self.contexts.projected if self.contexts is not None else ""
        return d


def _calibration_trace(calibration: Path, info: ModelInfo) -> Trace:
    rt = RoutingTrace.load(calibration, info=info)
    ids = rt.ids.astype(np.int32)
    return Trace(
        tokens=np.zeros(len(ids), np.int32),
        layers=np.asarray(rt.layers, np.int32),
        ids=ids,
        weights=np.zeros(ids.shape, np.float32),
        phase=rt.phase.astype(np.uint8),
        seq=rt.seq.astype(np.int32),
        meta={"n_expert": rt.n_expert, "model": str(info.path)},
    )


def make_layouts(
    model: str | Path,
    *,
    vram: int,
    n_ctx: int = 0,
    trace: Trace | None = None,
    calibration: Path | None = None,
    profile: MachineProfile | None = None,
    policies: tuple[str, ...] | None = None,
    routing: str | None = None,
    cache_type_k: KvCacheType = "f16",
    cache_type_v: KvCacheType = "f16",
    prompt_tokens: tuple[int, ...] = PROMPTS,
    flash_attn: bool = True,
) -> Layouts:
    """What `vram` bytes hold of `model` (its PlacementPlan's split) and how its slots would serve each policy, with
    a KV cache of `n_ctx` tokens of the given types (0: the context the plan picks for the budget, said in a note);
    `routing`: a bundled routing profile to project with instead of the calibration's trace (module docstring).
    With a GPU `profile`, also the prefill of `prompt_tokens`-token prompts (prefill_plan.py; `flash_attn`: "auto"
    is on with CUDA)."""
    policies = projected_policies() if policies is None else policies  # every policy the model replays
    header = check_gguf(model)
    info = model_info(header)
    placement = plan_placement(
        header,
        budget_request(vram),
        n_ctx=n_ctx,
        device=None,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
    )
    vp = placement.budget
    assert vp is not None  # a request with a budget has its split
    n_ctx = n_ctx or placement.n_ctx  # 0: the context the plan picked
    moe = list(info.moe_layers)
    lay = _new_layouts(model, vram, n_ctx, placement, len(moe), profile)
    lay.notes += [n.removeprefix("note: ") for n in placement.notes if n.startswith("note: context ")]
    if not vp.dense_fits:
        lay.notes.append(
            f"the dense weights, the KV cache of {n_ctx} tokens and the {vp.reserve_bytes >> 20} MiB "
            f"reserve need {(vp.dense_bytes + vp.kv_cache_bytes + vp.reserve_bytes) / 2**30:.2f} GiB: "
            "raise `vram` or lower `n_ctx`"
        )
        return lay
    dp = _dp_slots(info, policies, calibration, vp, lay)
    if dp:  # the first policy's DP slots are the table's; each policy row uses its own
        lay.slots_per_layer["dp"] = [next(iter(dp.values()))[il] for il in moe]
    trace = _routing_trace(info, trace, routing, calibration, lay)
    speeds = profile is not None and profile.has_gpu
    if not speeds:
        lay.notes.append(
            "no GPU profile: hit rates only; pass `profile` with a GPU machine's profile "
            "(`edgemoe profile` on it, or a bundled one: rtx4060-laptop, rtx4090-desktop, h100-server)"
        )
        lay.profile = ""
    kv = KvTypes(cache_type_k, cache_type_v)
    _expected_rows(model, trace, profile if speeds else None, policies, dp, calibration, lay, kv)
    if speeds and profile is not None and prompt_tokens:
        spec = PrefillSpec(vram, n_ctx, flash_attn=flash_attn, kv=KvTypes(cache_type_k, cache_type_v))
        _prefill_rows(ModelShape.from_header(header), trace, profile, spec, prompt_tokens, policies, lay)
    if speeds and profile is not None and lay.contexts is not None:
        lay.contexts = project_context_table(model, info, lay.contexts, trace, profile, calibration)
    if vp.all_experts_fit:  # chat/generate/serve then load it as stock does (PlacementPlan.whole_model_fits)
        lay.notes.append(
            "this budget holds the whole model: `edgemoe chat --vram` runs it on the GPU as stock "
            "llama.cpp's -ngl 999 does, without an expert cache (the rows above are what one would do)"
        )
    else:
        lay.suggestion = suggest(lay.expected, model=str(model), vram=vram, n_ctx=n_ctx)
    run = long_prompt_run(lay.prefill)
    if lay.suggestion is not None and not lay.suggestion["stock_faster"] and run is not None:
        lay.long_prompt = long_prompt(lay.suggestion, run, model=str(model), vram=vram)
    lay.notes.append(
        "promoe is not in the plan: the performance model replays no prefetcher (docs/research/prefetch.md)"
    )
    return lay


def _new_layouts(
    model: str | Path,
    vram: int,
    n_ctx: int,
    placement: PlacementPlan,
    n_moe: int,
    profile: MachineProfile | None,
) -> Layouts:
    """The Layouts of a PlacementPlan's split, before any projection."""
    vp = placement.budget
    assert vp is not None  # a request with a budget has its split
    return Layouts(
        model=Path(model).name,
        budget_bytes=vram,
        n_ctx=n_ctx,
        fits={
            "dense": vp.dense_bytes,
            "kv_cache": vp.kv_cache_bytes,
            "reserve": vp.reserve_bytes,
            "experts": vp.experts_per_layer * vp.slot_bytes,
        },
        slot_bytes=vp.slot_bytes,
        slots_per_layer={"equal": [vp.experts_per_layer] * n_moe, "dp": None},
        n_cpu_moe=placement.n_cpu_moe,
        profile=profile.name if profile else "",
        contexts=placement.context_table,
    )


def _prefill_rows(
    shape: ModelShape,
    trace: Trace,
    profile: MachineProfile,
    spec: PrefillSpec,
    prompt_tokens: tuple[int, ...],
    policies: tuple[str, ...],
    lay: Layouts,
) -> None:
    """`lay.prefill`: each prompt's prefill, stock and edgemoe (static, where the plan projects it, beside
    --device-prefill) each at its fastest ubatch; notes to `lay`."""
    # the policy placed by all of the router's counts (static) where the plan projects one, else the first
    placed = next((p for p in policies if policy_spec(p).frequency_phase == "all"), policies[0])
    spec = replace(spec, policy=placed)
    lay.prefill, skipped = project_prompts(shape, trace, profile, spec, prompt_tokens)
    lay.notes += skipped + [n for p in lay.prefill[:1] for n in p.notes if n not in lay.notes]


def _dp_slots(
    info: ModelInfo, policies: tuple[str, ...], calibration: Path | None, vp: SlotBudget, lay: Layouts
) -> dict[str, dict[int, int]]:
    """Each policy's DP allocation of the budget's expert bytes (AdapMoE's, from the calibration), where the
    calibration has one; the others' notes go to `lay`."""
    dp: dict[str, dict[int, int]] = {}
    for pol in policies:
        a = allocate_slots(
            info,
            alloc="dp",
            policy=pol,
            calibration=calibration,
            slots_per_layer=vp.experts_per_layer,
            budget_bytes=vp.expert_budget_bytes,
        )
        if a.alloc == "dp":
            dp[pol] = a.slots
        elif a.note and a.note not in lay.notes:
            lay.notes.append(a.note)
    return dp


def _routing_trace(
    info: ModelInfo, trace: Trace | None, routing: str | None, calibration: Path | None, lay: Layouts
) -> Trace:
    """The routing the plan projects with (the module docstring says which, when), named in `lay`."""
    moe = list(info.moe_layers)
    if trace is not None:
        lay.routing_profile = trace.meta.get("routing")
        lay.routing = (
            f"a synthetic trace of the {lay.routing_profile} routing profile ({trace.n_tokens} tokens)"
            if lay.routing_profile
            else f"trace of {trace.meta.get('model', '?')} ({trace.n_tokens} tokens)"
        )
    elif routing is None and calibration is not None:
        try:
            trace = _calibration_trace(calibration, info)
            lay.routing = f"the calibration's routing trace ({calibration}; in-sample for static and dp)"
        except EdgeMoeError as err:
            lay.notes.append(str(err))
    if trace is None:
        drawn = routing_for_model(info.n_expert, info.n_expert_used, len(moe), name=routing)
        trace, lay.routing, lay.routing_profile = drawn.trace, drawn.describe(), drawn.profile.name
        if drawn.profile.toy:
            lay.notes.append(
                f"{drawn.profile.name} is a TOY routing (a tiny trained fixture's), far less local "
                "than real models'"
            )
    return trace


def _expected_rows(
    model: str | Path,
    trace: Trace,
    profile: MachineProfile | None,
    policies: tuple[str, ...],
    dp: dict[str, dict[int, int]],
    calibration: Path | None,
    lay: Layouts,
    kv: KvTypes,
) -> None:
    """`lay.expected`: each policy's hit rates (and, with a GPU `profile`, projected speeds) at the equal
    and the DP allocations, beside stock's rows once each, the budget holding a KV cache of types `kv`."""
    vram, n_ctx, speeds = lay.budget_bytes, lay.n_ctx, profile is not None
    for alloc in ("equal", "dp"):
        for pol in policies:
            slots = dp.get(pol) if alloc == "dp" else None
            if alloc == "dp" and slots is None:
                continue
            # overlap: what the build runs with the cache on a GPU (stock runs in turn either way)
            spec = SimSpec(
                vram=vram,
                n_ctx=n_ctx,
                policies=(pol,),
                calibration=calibration,
                slots=slots,
                overlap=True,
                kv=kv,
            )
            res = simulate(model, trace, profile if profile is not None else _hit_rate_only(), spec)
            for c in res.configs:
                if c.kind == "stock" and alloc == "dp":
                    continue
                if c.kind == "stock" and any(r["config"] == c.name for r in lay.expected):
                    continue
                row: dict[str, Any] = {
                    "config": c.name,
                    "allocation": alloc if c.kind == "edgemoe" else None,
                    "hit_rate": c.hit_rate,
                    "decode_hit_rate": c.decode_hit_rate,
                }
                if speeds:
                    row.update(decode_tps=c.decode_tps, prefill_tps=c.prefill_tps, projected=True)
                lay.expected.append(row)
            if res.workload_note and res.workload_note not in lay.notes:
                lay.notes.append(res.workload_note)


def suggest(expected: list[dict[str, Any]], *, model: str, vram: int, n_ctx: int) -> dict[str, Any] | None:
    """The edgemoe row of `expected` with the fastest projected decode, its ratio to the fastest stock row and the
    `edgemoe chat` command that runs it; `stock_faster` when no edgemoe row beats stock (then the budget is better
    spent on stock llama.cpp's layout). None without projected speeds on both sides."""
    rows = [r for r in expected if r.get("decode_tps")]
    ours = [r for r in rows if r.get("allocation")]
    stock = [r for r in rows if not r.get("allocation")]
    if not ours or not stock:
        return None
    best = max(ours, key=lambda r: r["decode_tps"])
    base = max(stock, key=lambda r: r["decode_tps"])
    policy = best["config"].removeprefix("edgemoe-")
    command = (
        f"edgemoe chat {shlex.quote(model)} --vram {size_arg(vram)} --ctx {n_ctx} --policy {policy} "
        f"--alloc {best['allocation']}"
    )
    return {
        "config": best["config"],
        "allocation": best["allocation"],
        "decode_tps": best["decode_tps"],
        "stock": base["config"],
        "stock_decode_tps": base["decode_tps"],
        "vs_stock": best["decode_tps"] / base["decode_tps"],
        "stock_faster": base["decode_tps"] >= best["decode_tps"],
        "command": command,
        "projected": True,
    }


def long_prompt(sg: dict[str, Any], run: LongPromptRun, *, model: str, vram: int) -> dict[str, Any]:
    """The `edgemoe chat` command of `run` with the suggestion's policy and allocation, and why."""
    q, v, c, u = shlex.quote(model), size_arg(vram), run.n_ctx, run.n_ubatch
    pol, alloc, n = sg["config"].removeprefix("edgemoe-"), sg["allocation"], run.device_prefill_min_tokens
    # each command whole in one literal: a flag outside a command line would be a library message naming a CLI
    # flag (tests/test_messages.py)
    if run.borrow:
        command = (
            f"edgemoe chat {q} --vram {v} --ctx {c} --policy {pol} --alloc {alloc} -ub {u} --device-prefill {n} "
            "--device-prefill-borrow"
        )
    else:
        command = f"edgemoe chat {q} --vram {v} --ctx {c} --policy {pol} --alloc {alloc} -ub {u} --device-prefill {n}"
    why = (
        f"{run.prefill_tps:.0f} tok/s on the {run.prompt_tokens}-token prompt against stock's best "
        f"{run.stock_tps:.0f} at -ub {run.stock_ubatch} ({run.prefill_tps / run.stock_tps:.2f}x)"
    )
    if run.borrow and run.decode_ratio:
        why += (
            f"; borrowing keeps {run.more_slots} more slots per layer for decode ({run.decode_ratio:.3f}x its first "
            "tokens)"
        )
    return {"command": command, "why": why, "run": asdict(run), "projected": True}


def _hit_rate_only() -> MachineProfile:
    """Any GPU profile replays the policies' hit rates the same; its speeds are not reported."""
    from .profile import load_profile

    return load_profile("rtx4060-laptop")


def format_layouts(plan: Layouts) -> str:
    gib = 2**30
    f = plan.fits
    lines = [
        f"{plan.model} at {plan.budget_bytes / gib:.2f} GiB ({plan.n_ctx}-token context):",
        f"  dense {f['dense'] / gib:.2f} GiB + KV cache {f['kv_cache'] / gib:.2f} GiB + reserve "
        f"{f['reserve'] / gib:.2f} GiB + experts {f['experts'] / gib:.2f} GiB "
        f"({plan.slot_bytes / 2**20:.1f} MiB per slot across the MoE layers)",
    ]
    for name, slots in plan.slots_per_layer.items():
        if slots:
            text = " ".join(str(s) for s in slots) if len(set(slots)) > 1 else f"{slots[0]} in each"
            lines.append(f"  slots per MoE layer, {name}: {text}")
    if plan.n_cpu_moe is not None:
        lines.append(f"  stock llama.cpp at this budget: --n-cpu-moe {plan.n_cpu_moe}")
    if plan.expected:
        lines.append(
            f"  expected on {plan.routing}"
            + (f", PROJECTED on profile {plan.profile}:" if plan.profile else ":")
        )
    for row in plan.expected:
        parts = []
        if row.get("hit_rate") is not None:
            dec = row.get("decode_hit_rate")
            parts.append(
                f"hit rate {row['hit_rate']:.3f}" + (f" (decode {dec:.3f})" if dec is not None else "")
            )
        if "decode_tps" in row:
            parts.append(
                f"decode {row['decode_tps']:.1f} tok/s, prefill {row['prefill_tps']:.0f} tok/s at -ub 512"
            )
        alloc = f" [{row['allocation']}]" if row.get("allocation") else ""
        lines.append(f"    {row['config']}{alloc}: " + ", ".join(parts))
    sg = plan.suggestion
    if sg is not None and sg["stock_faster"]:
        lines.append(
            f"  PROJECTED fastest decode: stock llama.cpp ({sg['stock']}, {sg['stock_decode_tps']:.1f} "
            f"tok/s); edgemoe's best here, {sg['config']} [{sg['allocation']}], is {sg['vs_stock']:.2f}x of it"
        )
    elif sg is not None:
        lines.append(
            f"  PROJECTED fastest decode: {sg['config']} [{sg['allocation']}], {sg['vs_stock']:.2f}x "
            f"{sg['stock']}: `{sg['command']}`"
        )
    lines += format_prefill(plan.prefill)
    if (lp := plan.long_prompt) is not None:
        lines.append(f"  PROJECTED for long prompts: `{lp['command']}`: {lp['why']}")
    if plan.contexts is not None and plan.contexts.rows:
        lines += ["  " + line for line in format_context_table(plan.contexts, plan.n_ctx).splitlines()]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
