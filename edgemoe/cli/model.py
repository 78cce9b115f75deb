"""Commands on one model: inspect (header, what a VRAM budget holds), generate, chat."""

from __future__ import annotations

import io
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from ..errors import EdgeMoeError
from ..plan.request import CacheRequest
from .cache_options import cache_options
from .flags import cli_text
from .options import (
    AttentionOptions,
    RunOptions,
    gating_options,
    kv_type_options,
    run_options,
    speculation_options,
)
from .types import GGUFPath, Size

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


def _notify(message: str) -> None:
    click.echo(cli_text(message), err=True)


def _open_engine(
    model: Path,
    run: RunOptions,
    cache: CacheRequest | None = None,
    gating: Any = None,
    speculation: Any = None,
) -> Any:
    """edgemoe.placement.open_engine with the command's options, its notes on stderr."""
    from ..placement import open_engine

    return open_engine(
        model,
        cache=cache,
        n_ctx=run.n_ctx,
        n_threads=run.threads,
        n_gpu_layers=run.gpu_layers,
        **run.batch_kwargs(),
        **run.attention.load_kwargs(),
        calibration=gating.calibration if gating is not None else None,
        gating=gating,
        speculation=speculation,
        notify=_notify,
    )


@click.command()
@click.argument("model", type=GGUFPath())
@click.option(
    "--vram",
    type=Size(auto=True),
    default=None,
    help="show what a GPU budget like 8GiB can hold (auto: this GPU's free memory)",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=0),
    default=0,
    help="context length for the KV-cache estimate (default: with --vram, the context the plan picks for the "
    "budget, said in a note; else the model's, at most 4096)",
)
@kv_type_options
@click.option(
    "--profile",
    "profile_name",
    default=None,
    help="with --vram, a GPU machine profile (file or bundled name, e.g. rtx4060-laptop): also project the "
    "prefill of 2K/8K/32K-token prompts and the time to first token, each side at its fastest ubatch",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect(
    model: Path,
    vram: int | None,
    n_ctx: int,
    attention: AttentionOptions,
    profile_name: str | None,
    as_json: bool,
) -> None:
    """Show a model's architecture, experts and where its bytes are; with --vram, what the budget holds and the
    expert slots it leaves at each context length and KV cache type."""
    from ..analysis.report import format_info
    from ..analysis.rules import describe_rules, routing_rules
    from ..gguf.header import check_gguf
    from ..gguf.info import info_to_dict, model_info
    from ..plan.budget import budget_to_dict, format_slot_budget
    from ..plan.context import format_context_table, table_contexts
    from ..plan.planner import budget_request, plan

    header = check_gguf(model)
    info = model_info(header)
    placement = plan(
        header,
        budget_request(vram) if vram is not None else None,
        n_ctx=n_ctx,
        device=None,
        cache_type_k=attention.cache_type_k,
        cache_type_v=attention.cache_type_v,
    )
    n_ctx, budget = placement.n_ctx, placement.budget
    rules = routing_rules(model) if info.is_moe else {}  # loads the model and decodes one token
    prefill = (
        _prefill(header, vram, n_ctx, attention, profile_name)
        if profile_name and vram and info.is_moe
        else None
    )
    if as_json:
        d = info_to_dict(info)
        if info.is_moe:
            d["weight_rules"] = {
                str(il): {"rule": r.rule, "scale": r.scale} for il, r in sorted(rules.items())
            }
        if budget is not None:
            d["vram_plan"] = budget_to_dict(budget)
        if placement.context_table is not None:
            d["context_table"] = placement.context_table.to_rows()
        d["notes"] = [cli_text(n) for n in placement.notes]
        if prefill is not None:
            d["prefill"] = [asdict(p) for p in prefill[0]]
            d["notes"] += prefill[1]
        click.echo(json.dumps(d, indent=1))
        return
    click.echo(format_info(info))
    if info.is_moe:
        click.echo(f"{'weights':12} {describe_rules(rules)}  (as llama.cpp weights the selected experts)")
    if budget is not None and vram is not None:  # a budget is split only when one is given
        click.echo(format_slot_budget(budget))
        table = placement.context_table
        if table is not None and table.rows:
            click.echo(
                format_context_table(table, n_ctx if n_ctx in table_contexts(info.n_ctx_train) else None)
            )
        for note in placement.notes:
            click.echo(cli_text(note))
        if prefill is not None:
            from ..perf.model.prefill_plan import format_prefill

            click.echo("\n".join(format_prefill(prefill[0]) + [f"  note: {n}" for n in prefill[1]]))
        click.echo(
            f"{'':12} per-layer slots (equal and DP), expected hit rates and projected speeds: "
            f"`{plan_command(model, vram, n_ctx, attention)}`"
        )


def _prefill(header: Any, vram: int, n_ctx: int, attention: AttentionOptions, profile_name: str) -> Any:
    """inspect --profile: the prefill of 2K/8K/32K-token prompts at `vram`, each side at its fastest ubatch
    (edgemoe.perf.model.prefill_plan, as `edgemoe plan` projects it), on routing drawn from the bundled profile of
    the model's shape; (projections, notes)."""
    from ..analysis.routing_profile import routing_for_model
    from ..gguf.kv_types import KvTypes
    from ..perf.model.costmodel import ModelShape
    from ..perf.model.prefill_plan import PrefillSpec, project_prompts
    from ..perf.model.profile import load_profile

    prof = load_profile(profile_name)
    if not prof.has_gpu:
        raise click.UsageError(
            f"--profile {profile_name} has no GPU: the prefill projection needs a GPU profile"
        )
    shape = ModelShape.from_header(header)
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    spec = PrefillSpec(
        vram,
        n_ctx,
        flash_attn=attention.flash_attn != "off",
        kv=KvTypes(attention.cache_type_k, attention.cache_type_v),
    )
    return project_prompts(shape, trace, prof, spec)


def plan_command(model: Path, vram: int, n_ctx: int, attention: AttentionOptions | None = None) -> str:
    """The `edgemoe plan` command line for what inspect showed, ready to paste: the model's path as given
    (quoted for the shell), the budget in the largest binary unit that divides it, the context and the KV cache
    types (where not f16) inspect used."""
    from ..gguf.info import size_arg

    kv = attention or AttentionOptions()
    types = "".join(
        f" --{flag} {kind}"
        for flag, kind in (("cache-type-k", kv.cache_type_k), ("cache-type-v", kv.cache_type_v))
        if kind != "f16"
    )
    return f"edgemoe plan {shlex.quote(str(model))} --vram {size_arg(vram)} --ctx {n_ctx}{types}"


@click.command()
@click.argument("model", type=GGUFPath())
@click.option("-p", "--prompt", required=True, help="prompt text ('-' reads it from stdin)")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@run_options
@gating_options
@cache_options
@speculation_options
@click.option(
    "--json", "as_json", is_flag=True, help="print one JSON object with ids, timings and cache counters"
)
def generate(
    model: Path,
    prompt: str,
    max_tokens: int,
    run: RunOptions,
    gating: Any,
    cache: CacheRequest,
    speculation: Any,
    as_json: bool,
) -> None:
    """Complete a prompt (plain text streamed to stdout, or --json)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    sampling = run.sampling
    with _open_engine(model, run, cache, gating, speculation) as engine:
        if as_json:
            g = engine.generate(prompt, max_tokens=max_tokens, sampling=sampling)
            out = {
                "model": str(model),
                "text": g.text,
                "prompt_tokens": g.prompt_tokens,
                "tokens": g.tokens,
                "stop_reason": g.stop_reason,
                "n_threads": engine.n_threads,
                "timings": g.timings.to_dict(),
            }
            if engine.experts is not None:
                out["cache"] = dict(
                    engine.experts.stats(),
                    policy=cache.policy,
                    alloc=engine.experts.alloc,
                    **engine.experts.report(),
                )
            gating_report = engine.gating_report()
            if gating_report is not None:
                out["gating"] = gating_report
            if g.speculation is not None:
                out["speculation"] = g.speculation.to_dict()
            control = engine.control_stats()
            # a decode ubatch is one token: the routing callback's host syncs per token in decode
            control["host_syncs_per_ubatch"] = (
                control["n_host_syncs"] / control["n_ubatch"] if control["n_ubatch"] else None
            )
            out["control"] = dict(control, predictor_bytes=engine.predictor_bytes())
            click.echo(json.dumps(out))
            return
        for _, piece in engine.stream(prompt, max_tokens=max_tokens, sampling=sampling):
            click.echo(piece, nl=False)
        click.echo()
        click.echo(_stats_line(engine.last.timings, engine), err=True)


def _stats_line(t: Any, engine: Any = None) -> str:
    cache = ""
    if engine is not None and engine.experts is not None:
        st = engine.experts.stats()  # since the cache was set up
        cache = (
            f" | expert cache hit rate {st['hit_rate']:.2f}, {st['bytes_uploaded'] / 2**20:.1f} MiB loaded"
        )
    report = engine.gating_report() if engine is not None else None
    if report is not None and report["activation_reduction"] is not None:
        cache += f" | gating dropped {report['activation_reduction']:.0%} of gated experts"
    spec = engine.last.speculation if engine is not None and engine.last is not None else None
    if spec is not None:
        cache += f" | {spec.mode} accepted {spec.acceptance:.0%}, {spec.tokens_per_step:.2f} tok/step"
    return (
        f"[prompt {t.prompt_tokens} tok, {t.prompt_tps:.1f} tok/s | "
        f"decode {t.decode_tokens} tok, {t.decode_tps:.1f} tok/s | ttft {t.ttft_s * 1000:.0f} ms{cache}]"
    )


@click.command()
@click.argument("model", type=GGUFPath(), required=False)
@click.option("--system", default=None, help="system prompt")
@click.option(
    "-n",
    "--max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="most tokens per reply",
)
@run_options
@gating_options
@cache_options
@speculation_options
def chat(
    model: Path | None,
    system: str | None,
    max_tokens: int,
    run: RunOptions,
    gating: Any,
    cache: CacheRequest,
    speculation: Any,
) -> None:
    """Chat with a model (default: the bundled fixture). /reset clears history, /quit leaves.

    When stdin is not a terminal, each non-empty input line is one user message.
    """
    from ..runtime.engine import ChatSession

    if model is None:
        model = GGUFPath().convert(os.environ.get("EDGEMOE_MODEL", str(BUNDLED_MODEL)), None, None)
    sampling = run.sampling
    interactive = sys.stdin.isatty()
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")  # invalid UTF-8 becomes U+FFFD, not the end of the chat
    with _open_engine(model, run, cache, gating, speculation) as engine:
        session = ChatSession(engine, system=system)
        if interactive:
            click.echo(f"edgemoe chat · {model.name} · /reset clears history, /quit leaves", err=True)
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not interactive and line == "":
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                session.reset()
                click.echo("(history cleared)", err=True)
                continue
            dropped = session.dropped_turns
            try:
                for piece in session.send(text, max_tokens=max_tokens, sampling=sampling):
                    click.echo(piece, nl=False)
            except EdgeMoeError as err:  # this message fails; the conversation goes on
                click.echo(f"error: {cli_text(str(err))}", err=True)
                continue
            click.echo()
            if session.dropped_turns > dropped:
                n = session.dropped_turns - dropped
                click.echo(
                    f"({n} oldest turn{'s' if n > 1 else ''} dropped to fit the context of "
                    f"{engine.n_ctx} tokens)",
                    err=True,
                )
            click.echo(_stats_line(engine.last.timings, engine), err=True)
