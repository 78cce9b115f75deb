"""Commands on one model: inspect (header, VRAM plan), generate, chat."""
from __future__ import annotations

import io
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import EdgeMoeError
from .cache_options import cache_from_options, cache_options, install_cache, load_config
from .options import gating_from_options, gating_options
from .types import THREADS, Finite, GGUFPath, Size

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


def _run_options(f: Any) -> Any:
    opts = [
        click.option("--temp", "temperature", type=Finite(0.0), default=0.8, show_default=True,
                     help="sampling temperature; 0 = greedy (identical to stock llama.cpp; with an expert cache the "
                          "cached experts run other kernels and long outputs may differ, see docs/expert-cache.md)"),
        click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: off"),
        click.option("--top-p", type=Finite(0.0, 1.0), default=0.95, show_default=True),
        click.option("--min-p", type=Finite(0.0, 1.0), default=0.05, show_default=True),
        click.option("--repeat-penalty", type=Finite(0.0), default=1.0, show_default=True, help="1.0: off"),
        click.option("--seed", type=int, default=None, help="sampling seed (default: random)"),
        click.option("-t", "--threads", type=THREADS, default=0,
                     help="CPU threads (default: physical cores)", envvar="EDGEMOE_THREADS"),
        click.option("--ctx", "n_ctx", type=click.IntRange(min=0), default=0,
                     help="context length (default: the model's, at most 4096; llama.cpp rounds it up to a multiple of 256)"),
        click.option("-ngl", "--gpu-layers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="layers stock llama.cpp offloads whole to the GPU (CUDA builds)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _install_gating(engine: Any, opts: Any) -> None:
    from ..calibration.adaptive import build_gating

    policy = build_gating(engine, opts)
    if policy is not None:
        path = engine.set_gating(policy)
        where = "in the graph" if path == "graph" else "in the routing hook (blocking loads need it)"
        click.echo(f"gating: {opts.mode}, threshold {policy.threshold:.4g}, {where}"
                   + (" (prefill at full top-k)" if opts.decode_only else ""), err=True)


def _make_sampling(temperature: float, top_k: int, top_p: float, min_p: float,
                   repeat_penalty: float, seed: int | None) -> Any:
    from ..runtime.sampling import DEFAULT_SEED, SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=DEFAULT_SEED if seed is None else seed)


def _open_engine(model: Path, threads: int, n_ctx: int, gpu_layers: int, cache: Any = None,
                 calibration: Path | None = None) -> Any:
    from ..runtime.engine import Engine, LoadConfig

    config = LoadConfig(n_threads=threads, n_ctx=n_ctx, n_gpu_layers=gpu_layers)
    if cache is not None:
        config = load_config(config, cache, model)
    engine = Engine(model, config)
    if n_ctx and engine.n_ctx != n_ctx:
        click.echo(f"note: the context is {engine.n_ctx} tokens (llama.cpp sizes it in steps of 256; "
                   f"--ctx {n_ctx} was asked)", err=True)
    if not engine.info.is_moe:
        click.echo(f"note: {model.name} is a dense model (no routed experts); edgemoe's MoE "
                   "features are off and it runs as stock llama.cpp", err=True)
    elif cache is not None:
        try:
            install_cache(engine, model, cache, calibration)
        except BaseException:
            engine.close()
            raise
    return engine


@click.command()
@click.argument("model", type=GGUFPath())
@click.option("--vram", type=Size(auto=True), default=None,
              help="show what a GPU budget like 8GiB can hold (auto: this GPU's free memory)")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=0), default=0,
              help="context length for the KV-cache estimate (default: the model's, at most 4096)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect(model: Path, vram: int | None, n_ctx: int, as_json: bool) -> None:
    """Show a model's architecture, experts and where its bytes are."""
    from ..gguf.info import VRAM_RESERVE, info_to_dict, read_model_info, vram_plan
    from ..analysis.report import format_info, format_plan, plan_to_dict
    from ..analysis.rules import describe_rules, routing_rules
    from ..runtime.config import planned_ctx

    info = read_model_info(model)
    n_ctx = planned_ctx(n_ctx, info.n_ctx_train)
    plan = vram_plan(info, vram, n_ctx=n_ctx, reserve_bytes=VRAM_RESERVE) if vram is not None else None
    rules = routing_rules(model) if info.is_moe else {}  # loads the model and decodes one token
    if as_json:
        d = info_to_dict(info)
        if info.is_moe:
            d["weight_rules"] = {str(il): {"rule": r.rule, "scale": r.scale} for il, r in sorted(rules.items())}
        if plan is not None:
            d["vram_plan"] = plan_to_dict(plan)
        click.echo(json.dumps(d, indent=1))
        return
    click.echo(format_info(info))
    if info.is_moe:
        click.echo(f"{'weights':12} {describe_rules(rules)}  (as llama.cpp weights the selected experts)")
    if plan is not None:
        click.echo(format_plan(plan))
        click.echo(f"{'':12} per-layer slots (equal and DP), expected hit rates and projected speeds: "
                   f"`{plan_command(model, vram, n_ctx)}`")


def plan_command(model: Path, vram: int, n_ctx: int) -> str:
    """The `edgemoe plan` command line for what inspect showed, ready to paste: the model's path as given
    (quoted for the shell), the budget in the largest binary unit that divides it, the context inspect used."""
    from ..gguf.info import size_arg

    return f"edgemoe plan {shlex.quote(str(model))} --vram {size_arg(vram)} --ctx {n_ctx}"



@click.command()
@click.argument("model", type=GGUFPath())
@click.option("-p", "--prompt", required=True, help="prompt text ('-' reads it from stdin)")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@_run_options
@gating_options
@cache_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with ids, timings and cache counters")
def generate(model: Path, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
             min_p: float, repeat_penalty: float, seed: int | None, threads: int, n_ctx: int,
             gpu_layers: int, gating: str, threshold: float | None, target_reduction: float | None,
             calibration: Path | None, vram: int | None, expert_slots: int | None, policy: str,
             alloc: str | None, dali_window: int | None,
             dali_update: int | None, prefetch_distance: int | None,
             prefetch_extra: int | None, dali_prefetch: int | None, blocking_loads: bool,
             assign: str | None, profile: str | None, degrade: float | None, device_prefill: int,
             device_prefill_ahead: str, precalc_from: int | None, as_json: bool) -> None:
    """Complete a prompt (plain text streamed to stdout, or --json)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    sampling = _make_sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    gate = gating_from_options(model, gating, threshold, target_reduction, calibration, decode_only=True)
    cache = cache_from_options(vram, expert_slots, policy, blocking_loads, alloc, dali_window, dali_update,
                               prefetch_distance, prefetch_extra, dali_prefetch, assign, profile,
                               degrade, device_prefill, device_prefill_ahead, precalc_from)
    with _open_engine(model, threads, n_ctx, gpu_layers, cache, calibration) as engine:
        _install_gating(engine, gate)
        if as_json:
            g = engine.generate(prompt, max_tokens=max_tokens, sampling=sampling)
            out = {"model": str(model), "text": g.text, "prompt_tokens": g.prompt_tokens,
                   "tokens": g.tokens, "stop_reason": g.stop_reason,
                   "n_threads": engine.n_threads, "timings": g.timings.to_dict()}
            if engine.cache is not None:
                out["cache"] = dict(engine.cache.cache.stats(), policy=cache.policy, alloc=engine.cache.alloc,
                                    **engine.cache.report())
            gating_report = engine.gating_report()
            if gating_report is not None:
                out["gating"] = gating_report
            control = engine.control_stats()
            # a decode ubatch is one token: the routing callback's host syncs per token in decode
            control["host_syncs_per_ubatch"] = (control["n_host_syncs"] / control["n_ubatch"]
                                                if control["n_ubatch"] else None)
            out["control"] = dict(control, predictor_bytes=engine.predictor_bytes())
            click.echo(json.dumps(out))
            return
        for _, piece in engine.stream(prompt, max_tokens=max_tokens, sampling=sampling):
            click.echo(piece, nl=False)
        click.echo()
        click.echo(_stats_line(engine.last.timings, engine), err=True)


def _stats_line(t: Any, engine: Any = None) -> str:
    cache = ""
    if engine is not None and engine.cache is not None:
        st = engine.cache.cache.stats()  # since the cache was set up
        cache = f" | expert cache hit rate {st['hit_rate']:.2f}, {st['bytes_uploaded'] / 2**20:.1f} MiB loaded"
    report = engine.gating_report() if engine is not None else None
    if report is not None and report["activation_reduction"] is not None:
        cache += f" | gating dropped {report['activation_reduction']:.0%} of gated experts"
    return (f"[prompt {t.prompt_tokens} tok, {t.prompt_tps:.1f} tok/s | "
            f"decode {t.decode_tokens} tok, {t.decode_tps:.1f} tok/s | ttft {t.ttft_s * 1000:.0f} ms{cache}]")


@click.command()
@click.argument("model", type=GGUFPath(), required=False)
@click.option("--system", default=None, help="system prompt")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="most tokens per reply")
@_run_options
@gating_options
@cache_options
def chat(model: Path | None, system: str | None, max_tokens: int, temperature: float, top_k: int,
         top_p: float, min_p: float, repeat_penalty: float, seed: int | None, threads: int,
         n_ctx: int, gpu_layers: int, gating: str, threshold: float | None, target_reduction: float | None,
         calibration: Path | None, vram: int | None, expert_slots: int | None, policy: str,
         alloc: str | None, dali_window: int | None,
             dali_update: int | None, prefetch_distance: int | None,
             prefetch_extra: int | None, dali_prefetch: int | None, blocking_loads: bool,
             assign: str | None, profile: str | None, degrade: float | None, device_prefill: int,
             device_prefill_ahead: str, precalc_from: int | None) -> None:
    """Chat with a model (default: the bundled fixture). /reset clears history, /quit leaves.

    When stdin is not a terminal, each non-empty input line is one user message.
    """
    from ..runtime.engine import ChatSession

    if model is None:
        model = GGUFPath().convert(os.environ.get("EDGEMOE_MODEL", str(BUNDLED_MODEL)), None, None)
    sampling = _make_sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    gate = gating_from_options(model, gating, threshold, target_reduction, calibration, decode_only=True)
    cache = cache_from_options(vram, expert_slots, policy, blocking_loads, alloc, dali_window, dali_update,
                               prefetch_distance, prefetch_extra, dali_prefetch, assign, profile,
                               degrade, device_prefill, device_prefill_ahead, precalc_from)
    interactive = sys.stdin.isatty()
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")  # invalid UTF-8 becomes U+FFFD, not the end of the chat
    with _open_engine(model, threads, n_ctx, gpu_layers, cache, calibration) as engine:
        _install_gating(engine, gate)
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
                click.echo(f"error: {err}", err=True)
                continue
            click.echo()
            if session.dropped_turns > dropped:
                n = session.dropped_turns - dropped
                click.echo(f"({n} oldest turn{'s' if n > 1 else ''} dropped to fit the context of "
                           f"{engine.n_ctx} tokens)", err=True)
            click.echo(_stats_line(engine.last.timings, engine), err=True)
