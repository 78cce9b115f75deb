"""`edgemoe profile` and `edgemoe simulate`: the performance model (edgemoe.perf.measure.profiling,
edgemoe.perf.model.simulate)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..analysis.routing_profile import routing_names
from ..policies.registry import compared_policies, projected_policies
from .flags import cli_text
from .options import AttentionOptions, flash_attn_option, kv_type_options, option_group
from .types import THREADS, Finite, GGUFPath, OutputPath, PolicyName, Size

if TYPE_CHECKING:
    from ..gguf.kv_types import FlashAttn


def _speculation_projection_options(f: Any) -> Any:
    """--draft-max and --acceptance of simulate and plan: speculative decoding's projection."""
    from ..speculation.config import DRAFT_MAX_LIMIT

    f = click.option(
        "--acceptance",
        "acceptances",
        type=click.FloatRange(0.0, 1.0),
        multiple=True,
        default=(0.5, 0.7, 0.9),
        show_default=True,
        help="per-token acceptance rates to project speculation at (repeatable)",
    )(f)
    return click.option(
        "--draft-max",
        type=click.IntRange(0, DRAFT_MAX_LIMIT),
        default=0,
        show_default=True,
        help="also project speculative decoding verifying this many proposals per step (0: not); prompt lookup's "
        "cost, a draft model's own decoding is not priced",
    )(f)


def _routing_options(
    trace_help: str, routing_help: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--trace PATH and --routing NAME (a bundled routing profile), the routing a projection replays."""
    trace = click.option(
        "--trace",
        "trace_path",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help=trace_help,
    )
    routing = click.option("--routing", type=click.Choice(routing_names()), default=None, help=routing_help)
    return lambda f: trace(routing(f))


@click.command()
@click.option(
    "--out",
    type=OutputPath(),
    default=None,
    help="write the profile here (default: ~/.cache/edgemoe/profiles/this-machine.json)",
)
@click.option("-t", "--threads", type=THREADS, default=0, help="CPU threads (default: physical cores)")
@click.option(
    "--model",
    type=GGUFPath(),
    default=None,
    help="also measure the ggml types this model uses (default: Q4_K, Q5_K, Q6_K, Q8_0, F16, F32), and its decode "
    "attention's head shape (default: Qwen3-30B-A3B's)",
)
@click.option("--json", "as_json", is_flag=True, help="print the profile as JSON")
def profile(out: Path | None, threads: int, model: Path | None, as_json: bool) -> None:
    """Measure this machine for the performance model: expert and matrix speeds per ggml type and token
    count, graph-node and per-call costs, memory bandwidth (on a CUDA build also the GPU and its link)."""
    from ..perf.measure.profiling import default_profile_path, measure_profile, summary

    with click.progressbar(length=100, label="profiling", file=click.get_text_stream("stderr")) as bar:  # pyright: ignore[reportCallIssue]  # click 8.5 types its deprecated names object
        done = [0]

        def progress(share: float) -> None:
            step = int(share * 100) - done[0]
            if step > 0:
                bar.update(step)
                done[0] += step

        prof = measure_profile(threads=threads, model=model, progress=progress)
    path = prof.save(out or default_profile_path())
    click.echo(json.dumps(prof.to_dict(), indent=1) if as_json else summary(prof))
    click.echo(f"profile written to {path}", err=True)


def _check_simulate(
    gating: str | None,
    threshold: float | None,
    precalc_from: int | None,
    blocking_loads: bool,
    attention: AttentionOptions,
    flash_attn: FlashAttn,
) -> None:
    """simulate's refusals of option combinations, as usage errors."""
    from ..gguf.kv_types import is_quantized

    if (gating is None) != (threshold is None):
        raise click.UsageError("--gating and --threshold go together")
    if is_quantized(attention.cache_type_v) and flash_attn == "off":
        raise click.UsageError(
            f"--cache-type-v {attention.cache_type_v} needs flash attention (llama.cpp reads a quantized V "
            "cache only in it): drop --flash-attn off or use --cache-type-v f16"
        )
    if precalc_from is not None and blocking_loads:
        raise click.UsageError(
            "--precalc-from needs the cache's tables in the graph, which --blocking-loads "
            "replaces with the routing hook: drop one"
        )


def _placement_options(f: Any) -> Any:
    """What simulate places: the budget, the context, the ubatch and the policies; given as `placed`."""
    return option_group("placed", [
        click.option("--vram", type=Size(), default="8GiB", show_default=True, help="GPU budget; 0: CPU only"),
        click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=4096, show_default=True,
                     help="context the KV cache is planned for"),
        click.option("--ubatch", "n_ubatch", type=click.IntRange(min=1), default=512, show_default=True),
        click.option("--policy", "policies", multiple=True, type=PolicyName(projected_policies), default=None,
                     help="edgemoe cache policies to project (repeatable; default: "
                     + ", ".join(compared_policies()) + ")"),
        click.option("--calibration", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="calibration directory for the static policy (default: placement from the trace's first "
                     "half)"),
    ], lambda **kw: kw)(f)  # fmt: skip


def _variant_options(f: Any) -> Any:
    """The edgemoe variants simulate adds and how edgemoe runs: gating, blocking loads, the overlap, an assigner,
    device prefill, pre-calculation; given as `variants`."""
    return option_group("variants", [
        click.option("--gating", type=click.Choice(["score", "ser"]), default=None,
                     help="add gated edgemoe configurations with this adaptive top-k rule (decode steps)"),
        click.option("--threshold", type=Finite(0.0), default=None, help="the gating rule's threshold"),
        click.option("--blocking-loads", is_flag=True,
                     help="cache misses wait for their copy instead of running on the CPU"),
        click.option("--overlap", is_flag=True,
                     help="project edgemoe's CPU/GPU overlap within a layer, as the build runs a cache on a GPU by "
                     "default (without it: the two branches one after the other, as with CacheConfig(overlap=False); "
                     "stock llama.cpp's configurations always run them in turn)"),
        click.option("--assign", type=click.Choice(["greedy", "ratio", "exact"]), default=None,
                     help="add edgemoe variants whose prefill ubatches split experts between CPU and GPU with this "
                     "assigner (DALI's greedy, the ratio cut, the exact optimum; CPU and GPU run at once)"),
        click.option("--device-prefill", is_flag=True,
                     help="add edgemoe variants whose prefill ubatches run every routed expert on the GPU, those "
                     "outside the slots copied into a prefill buffer one cached layer ahead (generate's "
                     "--device-prefill)"),
        click.option("--precalc-from", type=click.IntRange(min=1), default=None, metavar="L",
                     help="add edgemoe variants whose decode steps pre-calculate each cached MoE layer's CPU experts "
                     "from layer L on one layer early (generate's --precalc-from), at the rates below"),
        click.option("--precalc-recall", type=click.FloatRange(0.0, 1.0), default=0.78, show_default=True,
                     help="share of a target layer's CPU expert work computed early (generate --json's "
                     "cache.precalc.early_share; the default is the fixtures' from layer 5, docs/research/daop.md)"),
        click.option("--precalc-precision", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.79,
                     show_default=True,
                     help="share of the early computations that are used (cache.precalc.precision; the fixtures' "
                     "from layer 5)"),
    ], lambda **kw: kw)(f)  # fmt: skip


@click.command()
@click.argument("model", type=GGUFPath())
@_routing_options(
    "routing trace to replay (`edgemoe trace`, `edgemoe trace-synth`); another model's trace works if "
    "it has the same expert count and top-k (default: a trace drawn from the bundled routing profile of "
    "a real model with the model's expert count and top-k, else the nearest; see --routing)",
    "draw the trace from this bundled routing profile instead (at the model's shape)",
)
@click.option(
    "--profile",
    "profile_name",
    default=None,
    help="profile file (`edgemoe profile`) or bundled name (rtx4060-laptop, rtx4090-desktop, "
    "h100-server, and the backtest's machines: docs/research/performance-model.md); default: this "
    "machine's measured profile",
)
@_placement_options
@_variant_options
@_speculation_projection_options
@flash_attn_option(
    "the projected engine's flash attention (auto: on, as llama.cpp resolves it on the CPU and CUDA); a profile "
    "that measured the CPU's decode attention prices it with or without"
)
@kv_type_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plot", type=OutputPath(), default=None, help="write a PNG bar chart")
def simulate(
    model: Path,
    trace_path: Path | None,
    routing: str | None,
    profile_name: str | None,
    placed: dict[str, Any],
    variants: dict[str, Any],
    draft_max: int,
    acceptances: tuple[float, ...],
    flash_attn: FlashAttn,
    attention: AttentionOptions,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Project decode/prefill tokens/s, TTFT, hit rate and PCIe traffic of stock llama.cpp placements and
    edgemoe policies onto a machine profile by replaying a routing trace. Every figure is a projection."""
    from ..gguf.kv_types import KvTypes
    from ..perf.model.report import plot_simulation
    from ..perf.model.simulate import PrecalcSpec, SimSpec
    from ..perf.model.simulate import simulate as run
    from ..perf.model.workload import GatingSpec
    from ..policies.gating import GatingRule

    v = variants
    gating, threshold, precalc_from = v["gating"], v["threshold"], v["precalc_from"]
    _check_simulate(gating, threshold, precalc_from, v["blocking_loads"], attention, flash_attn)
    prof = _sim_profile(profile_name)
    gate = (
        GatingSpec(GatingRule(gating), float(threshold))
        if gating is not None and threshold is not None
        else None
    )
    precalc = PrecalcSpec(precalc_from, v["precalc_recall"], v["precalc_precision"]) if precalc_from else None
    spec = SimSpec(
        vram=placed["vram"],
        n_ctx=placed["n_ctx"],
        n_ubatch=placed["n_ubatch"],
        policies=placed["policies"] or compared_policies(),
        gated=gate is not None,
        blocking=v["blocking_loads"],
        overlap=v["overlap"],
        calibration=placed["calibration"],
        assign=v["assign"],
        device_prefill=v["device_prefill"],
        precalc=precalc,
        flash_attn=flash_attn,
        kv=KvTypes(attention.cache_type_k, attention.cache_type_v),
    )
    trace, where, profile_used = _routing_trace(model, trace_path, routing)
    if gate is not None and profile_used is not None:
        raise click.UsageError(
            "--gating needs router weights, which a drawn routing trace does not have: pass a "
            "recorded --trace (`edgemoe trace`)"
        )
    res = run(model, trace, prof, spec, gating=gate)
    spec_rows = (
        _speculation(model, trace, prof, spec, draft_max, acceptances, gating=gate, plain=res)
        if draft_max
        else None
    )
    if plot is not None:
        plot_simulation(res, plot)
    _print_simulation(res, spec_rows, where, profile_used, as_json)


def _print_simulation(res: Any, spec_rows: Any, where: str, profile_used: str | None, as_json: bool) -> None:
    """simulate's output: the routing replayed, every configuration and, where projected, speculation's rows."""
    from ..perf.model.report import format_simulation
    from ..perf.model.speculation import format_speculation

    if as_json:
        out = {**res.to_dict(), "routing": where, "routing_profile": profile_used}
        if spec_rows is not None:
            out["speculation"] = [asdict(r) for r in spec_rows]
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"routing: {where}\n{format_simulation(res)}")
    if spec_rows is not None:
        click.echo(format_speculation(spec_rows))


def _speculation(
    model: Path, trace: Any, prof: Any, spec: Any, draft: int, acceptances: tuple[float, ...], **given: Any
) -> Any:
    """The speculation rows of simulate and plan (edgemoe.perf.model.speculation); `given`: its gating and the
    plain simulation where the command has them."""
    from ..perf.model.speculation import project_speculation

    return project_speculation(model, trace, prof, spec, draft, sorted(set(acceptances)), **given)


def _sim_profile(profile_name: str | None) -> Any:
    """simulate's profile: --profile's, else this machine's measured one (a usage error where there is none)."""
    from ..perf.measure.profiling import default_profile_path
    from ..perf.model.profile import load_profile

    if profile_name is None:
        mine = default_profile_path()
        if not mine.exists():
            raise click.UsageError(
                f"no profile of this machine at {mine}: run `edgemoe profile` first, or pass "
                "--profile with a bundled name (rtx4060-laptop, rtx4090-desktop, h100-server)"
            )
        profile_name = str(mine)
    return load_profile(profile_name)


def _routing_trace(model: Path, trace_path: Path | None, routing: str | None) -> tuple[Any, str, str | None]:
    """simulate's trace: --trace, else one drawn from --routing or the bundled profile matching the model's shape;
    with what to call it and the routing profile's name (None: a recorded trace)."""
    from ..analysis.routing_profile import routing_for_model
    from ..analysis.trace import Trace
    from ..gguf.info import read_model_info

    if trace_path is not None:
        if routing is not None:
            raise click.UsageError("give --trace or --routing, not both")
        tr = Trace.load(trace_path)
        name = tr.meta.get("routing")
        return (
            tr,
            f"{trace_path} ({tr.n_tokens} tokens"
            + (f", drawn from the {name} routing profile)" if name else ")"),
            name,
        )
    info = read_model_info(model)
    drawn = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers), name=routing)
    return drawn.trace, drawn.describe(), drawn.profile.name


@click.command()
@click.argument("model", type=GGUFPath())
@click.option(
    "--vram", type=Size(auto=True), default=None, help="GPU budget, e.g. 8GiB (auto: this GPU's free memory)"
)
@click.option(
    "--expert-slots",
    type=click.IntRange(min=0),
    default=None,
    help="expert slots per MoE layer instead of --vram (the budget that leaves them)",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=0),
    default=0,
    help="context the KV cache is planned for (default: with --vram, the largest of the context table's that "
    "keeps >= 75% of the expert slots at 4096, said in a note; with --expert-slots, the model's, at most 4096)",
)
@click.option(
    "--profile",
    "profile_name",
    default=None,
    help="machine profile for projected speeds (file or bundled name; default: this machine's, if measured)",
)
@_routing_options(
    "routing trace for the expected figures (default: the calibration's routing trace, else a trace "
    "drawn from the bundled routing profile of a real model with the model's expert count and top-k, "
    "else the nearest; the plan names it)",
    "draw the expected figures' trace from this bundled routing profile instead",
)
@click.option(
    "--calibration",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="calibration directory (default: the model's)",
)
@kv_type_options
@_speculation_projection_options
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="project the prefill of an N-token prompt (default: 2048, 8192 and 32768 tokens, those the model's "
    "training context holds), stock and edgemoe each at its fastest ubatch, and the GPU's ceiling with every "
    "expert resident; needs a GPU profile",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def plan(
    model: Path,
    vram: int | None,
    expert_slots: int | None,
    n_ctx: int,
    profile_name: str | None,
    trace_path: Path | None,
    routing: str | None,
    calibration: Path | None,
    attention: AttentionOptions,
    prompt_tokens: int | None,
    draft_max: int,
    acceptances: tuple[float, ...],
    as_json: bool,
) -> None:
    """What a VRAM budget holds: dense part, KV cache, expert slots per MoE layer (equal and DP), the expected
    hit rate of each policy and, with a GPU profile, projected decode/prefill speeds, the fastest
    configuration (edgemoe's, with the command that runs it, or stock's where stock is faster), the prefill of
    long prompts (time to first token) at the ubatch each side prefills fastest with, the GPU's ceiling with
    every expert resident, decode's first tokens after the prompt with and without borrowing the slots, and the
    command for long prompts where edgemoe prefills faster than stock; then the expert slots at
    each context length (4K..128K, up to the model's training context) and KV cache type, with a GPU profile the
    static policy's projected speeds at them; and the calibration's adaptive top-k table, where it has one
    (`edgemoe calibrate --stage gating`: each rule's NLL, mean KL divergence and same-top rate at 10/25/40% fewer
    activations and at the default threshold)."""
    from ..analysis.trace import Trace
    from ..calibration.adaptive import default_calibration_dir
    from ..gguf.info import read_model_info
    from ..gguf.kv_types import KvTypes
    from ..perf.measure.profiling import default_profile_path
    from ..perf.model.layouts import make_layouts
    from ..perf.model.prefill_plan import PROMPTS
    from ..perf.model.profile import load_profile
    from ..plan.budget import engine_ctx
    from ..plan.reserve import budget_for_slots

    if vram is not None and expert_slots is not None:
        raise click.UsageError(
            "give --vram SIZE or --expert-slots N, not both (--expert-slots plans the budget "
            "that holds N slots per MoE layer)"
        )
    if vram is None and expert_slots is None:
        raise click.UsageError("give --vram SIZE or --expert-slots N")
    if trace_path is not None and routing is not None:
        raise click.UsageError("give --trace or --routing, not both")
    if vram is None:
        assert expert_slots is not None
        info = read_model_info(model)
        n_ctx = engine_ctx(n_ctx, info.n_ctx_train)  # the slots asked are at this context, not a picked one
        vram = budget_for_slots(
            info, expert_slots, n_ctx, KvTypes(attention.cache_type_k, attention.cache_type_v)
        )
    if profile_name is None and default_profile_path().exists():
        profile_name = str(default_profile_path())
    prof = load_profile(profile_name) if profile_name else None
    cal = calibration or default_calibration_dir(model)
    result = make_layouts(
        model,
        vram=vram,
        n_ctx=n_ctx,
        trace=Trace.load(trace_path) if trace_path else None,
        calibration=cal if cal is not None and cal.exists() else None,
        profile=prof,
        routing=routing,
        cache_type_k=attention.cache_type_k,
        cache_type_v=attention.cache_type_v,
        prompt_tokens=(prompt_tokens,) if prompt_tokens is not None else PROMPTS,
        flash_attn=attention.flash_attn != "off",
    )
    spec_rows, where = None, ""
    if draft_max and prof is not None:
        from ..gguf.kv_types import KvTypes
        from ..perf.model.simulate import SimSpec

        trace, where, _used = _routing_trace(model, trace_path, routing)
        kv = KvTypes(attention.cache_type_k, attention.cache_type_v)
        sim = SimSpec(vram=vram, n_ctx=result.n_ctx, flash_attn=attention.flash_attn, kv=kv)
        spec_rows = _speculation(model, trace, prof, sim, draft_max, acceptances)
    _print_plan(result, spec_rows, where, as_json, cal if cal is not None and cal.exists() else None)


def _print_plan(
    result: Any, spec_rows: Any, where: str, as_json: bool, calibration: Path | None = None
) -> None:
    """plan's output: the layouts and, where projected, speculation's rows and the routing they replayed; the
    adaptive top-k costs of the `calibration`, where it has them (gating_quality.json; one JSON object with
    --json)."""
    from ..calibration.gating_stage import format_gating_quality, load_gating_quality
    from ..perf.model.layouts import format_layouts
    from ..perf.model.speculation import format_speculation

    gating = load_gating_quality(calibration)
    if as_json:
        out = result.to_dict()
        if spec_rows is not None:
            out["speculation"] = [asdict(r) for r in spec_rows]
            out["speculation_routing"] = where
        if gating is not None:
            out["gating_quality"] = gating
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(cli_text(format_layouts(result)))
    if spec_rows is not None:
        click.echo(format_speculation(spec_rows, where))
    if gating is not None:
        click.echo("\n" + cli_text(format_gating_quality(gating)))
