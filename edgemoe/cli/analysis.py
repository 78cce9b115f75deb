"""edgemoe CLI, analysis commands: trace, trace-stats, verify, perplexity (registered by edgemoe.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..analysis.routing_profile import routing_names
from .kld_options import KldOptions, kld_options, kld_sink
from .options import AttentionOptions, attention_options, gating_options
from .types import THREADS, GGUFPath, IntList, OutputPath


@click.command()
@click.argument("model", type=GGUFPath())
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="text file to run through the model",
)
@click.option(
    "--out",
    "out_path",
    type=OutputPath(),
    required=True,
    help="trace file to write (.npz); written only when complete",
)
@click.option("--heldout", is_flag=True, help="trace only the held-out split (the last 10%) of --input")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="trace at most this many tokens of the input",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=16),
    default=512,
    show_default=True,
    help="tokens per sequence: the input is cut into chunks of this size",
)
@click.option(
    "--mode",
    type=click.Choice(["prefill", "decode"]),
    default="prefill",
    show_default=True,
    help="prefill: each chunk in one prefill; decode: a short prefill, then one token per decode",
)
@click.option(
    "--prefill-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="with --mode decode: tokens prefilled before decoding starts",
)
@click.option("--gate-inputs", is_flag=True, help="also record the router inputs (hidden states, float16)")
@click.option("--probs", is_flag=True, help="also record the full router probabilities")
@click.option("-t", "--threads", type=THREADS, default=0, envvar="EDGEMOE_THREADS")
@attention_options
def trace(
    model: Path,
    input_path: Path,
    heldout: bool,
    out_path: Path,
    max_tokens: int,
    n_ctx: int,
    mode: str,
    prefill_tokens: int,
    gate_inputs: bool,
    probs: bool,
    threads: int,
    attention: AttentionOptions,
) -> None:
    """Record which experts every MoE layer picks for every token of a text."""
    from ..analysis.trace import record_trace
    from ..calibration.corpus import split_corpus
    from ..progress import progress_bar
    from ..runtime.engine import Engine, LoadConfig

    if heldout:
        text = split_corpus(input_path).heldout_text()
    else:
        text = input_path.read_text(encoding="utf-8", errors="replace")
    with Engine(model, LoadConfig(n_ctx=n_ctx, n_threads=threads, **attention.load_kwargs())) as eng:
        if not eng.info.is_moe:
            raise click.ClickException(f"{model.name} is a dense model: there are no experts to trace")
        tokens = eng.tokenize(text)[:max_tokens]
        with progress_bar(len(tokens), "trace", unit="tok") as bar:
            tr = record_trace(
                eng,
                tokens,
                ctx=n_ctx,
                mode=mode,
                prefill_tokens=prefill_tokens,
                probs=probs,
                gate_inputs=gate_inputs,
                progress=bar,
            )
    tr.meta["input"] = str(input_path)
    tr.meta["heldout"] = heldout
    tr.save(out_path)
    click.echo(
        f"wrote {out_path}: {tr.n_tokens} tokens x {len(tr.layers)} MoE layers x top-{tr.ids.shape[2]} "
        f"({mode})",
        err=True,
    )


@click.command()
@click.argument("model", type=GGUFPath())
@click.option("-t", "--threads", type=THREADS, default=0, envvar="EDGEMOE_THREADS")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def verify(model: Path, threads: int, as_json: bool) -> None:
    """Check that edgemoe's MoE hook reproduces stock llama.cpp on MODEL (exit 1 if a check fails)."""
    from ..analysis.verify import run_checks

    results = run_checks(model, threads=threads)
    ok = all(r.ok for r in results)
    if as_json:
        click.echo(json.dumps({"model": str(model), "ok": ok, "checks": [r.to_dict() for r in results]}))
    else:
        for r in results:
            click.echo(f"{'PASS' if r.ok else 'FAIL'}  {r.name:<10} {r.detail}")
    if not ok:
        raise SystemExit(1)


@click.command("trace-stats")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--model",
    type=GGUFPath(),
    default=None,
    help="the GGUF the trace came from (default: the path in the trace), for gate-reuse accuracy",
)
@click.option(
    "--window",
    type=click.IntRange(min=2),
    default=32,
    show_default=True,
    help="tokens per window for the high-workload adjacency",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option(
    "--plots",
    "plots_dir",
    type=OutputPath(directory=True),
    default=None,
    help="write PNG figures into this directory",
)
@click.option(
    "--lru-sizes",
    type=IntList(),
    default=None,
    metavar="N,N,...",
    help="LRU cache sizes (experts per MoE layer) to replay, e.g. 24,32,49 (default: 8 sizes from top-k "
    "to the expert count)",
)
def trace_stats(
    trace_path: Path,
    model: Path | None,
    window: int,
    as_json: bool,
    plots_dir: Path | None,
    lru_sizes: list[int] | None,
) -> None:
    """Routing statistics of a trace: frequency, locality, reuse over the next token and 8 tokens, prompt
    coverage, similarity, gate reuse, LRU hit rates (per layer and the mean, `lru_hit_rate_mean`)."""
    from ..analysis.report import format_stats
    from ..analysis.trace import Trace
    from ..analysis.trace_stats import compute_stats
    from ..gguf.routers import load_routers

    tr = Trace.load(trace_path)
    routers = None
    if tr.gate_inputs is not None:
        src = model or Path(str(tr.meta.get("model", "")))
        if src.is_file():
            routers = load_routers(str(src), [int(x) for x in tr.layers])
    if lru_sizes and max(lru_sizes) > tr.n_expert:
        raise click.BadParameter(
            f"the trace routes {tr.n_expert} experts per layer: use sizes up to that",
            param_hint="--lru-sizes",
        )
    st = compute_stats(tr, routers=routers, window=window, lru_sizes=lru_sizes)
    d = st.to_dict()
    d["trace"] = {
        "path": str(trace_path),
        "tokens": tr.n_tokens,
        "mode": tr.meta.get("mode"),
        "model": tr.meta.get("model"),
        "input": tr.meta.get("input"),
        "routing": tr.meta.get("routing"),
    }
    if plots_dir is not None:
        from ..analysis.trace_plots import write_plots

        d["plots"] = [
            str(p) for p in write_plots(st, plots_dir, Path(str(tr.meta.get("model", "trace"))).stem)
        ]
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo(format_stats(d))


@click.command("trace-synth")
@click.option(
    "--routing",
    type=click.Choice(routing_names()),
    required=True,
    help="bundled routing profile: a real model's (calibrated on published traces) or fixture-qwen3moe "
    "(the tiny trained fixture's, a toy far less local than real models)",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    required=True,
    help="tokens to draw, rounded up to whole prompts of --seq-len",
)
@click.option("--out", "out_path", type=OutputPath(), required=True, help="trace file to write (.npz)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="tokens per prompt (expert popularity drifts from one prompt to the next)",
)
@click.option(
    "--prefill-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="tokens of each prompt marked prefill, the rest decode (default: half of --seq-len)",
)
@click.option(
    "--experts", type=click.IntRange(min=1), default=None, help="routed experts (default: the profile's)"
)
@click.option(
    "--top-k", type=click.IntRange(min=1), default=None, help="experts per token (default: the profile's)"
)
@click.option(
    "--layers", type=click.IntRange(min=1), default=None, help="MoE layers (default: the profile's)"
)
def trace_synth(
    routing: str,
    tokens: int,
    out_path: Path,
    seed: int,
    seq_len: int,
    prefill_tokens: int | None,
    experts: int | None,
    top_k: int | None,
    layers: int | None,
) -> None:
    """Write a synthetic routing trace drawn from a bundled routing profile (`trace-stats`, `simulate --trace`
    and `plan --trace` read it); the trace's meta names the routing. Expert weights carry no information."""
    from ..analysis.routing_profile import load_routing_profile

    prof = load_routing_profile(routing)
    seq_len = min(seq_len, tokens)
    prefill = seq_len // 2 if prefill_tokens is None else min(prefill_tokens, seq_len)
    n_seq = -(-tokens // seq_len)
    tr = prof.synthesize(
        n_expert=experts,
        k=top_k,
        n_layer=layers,
        n_seq=n_seq,
        prefill=prefill,
        decode=seq_len - prefill,
        seed=seed,
    )
    tr.save(out_path)
    click.echo(
        f"wrote {out_path}: {tr.n_tokens} tokens ({n_seq} prompts of {seq_len}, {prefill} prefill) x "
        f"{len(tr.layers)} MoE layers x top-{tr.ids.shape[2]} of {tr.n_expert}, routing {prof.name}"
        + (" (TOY)" if prof.toy else ""),
        err=True,
    )


@click.command()
@click.argument("model", type=GGUFPath())
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="text to score (use held-out text)",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=16),
    default=512,
    show_default=True,
    help="tokens per chunk; each chunk is a fresh sequence",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="score at most this many tokens")
@gating_options
@click.option(
    "--degrade",
    "degrade_ratio",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="DAOP's graceful degradation with ratio r: a token's non-resident expert (not its top-1) is "
    "replaced by a resident one it did not select whose router score is >= r times its own; the "
    "residency is DAOP's with --expert-slots per MoE layer, swapped by each chunk's prompt",
)
@click.option(
    "--precalc-from",
    type=click.IntRange(min=1),
    default=None,
    metavar="L",
    help="DAOP's pre-calculation from MoE layer L on, as llama.cpp runs it: each chunk runs twice, its "
    "prompt in one ubatch and the rest one token at a time, without and with it, over an expert "
    "cache of --expert-slots per layer holding the calibration's most used decode experts (DAOP's "
    "placement, not swapped); reports both NLLs, their top-1 agreement, the mean KL divergence between "
    "them and the share of the CPU's expert executions that ran a layer early",
)
@click.option(
    "--expert-slots",
    type=click.IntRange(min=0),
    default=None,
    help="with --degrade or --precalc-from: DAOP's slots per MoE layer (the resident experts)",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="score each chunk only after its first P tokens (with --degrade: the prompt DAOP swaps by, "
    "never degraded; default 32 with --degrade, else 0); compare runs with the same P",
)
@click.option("-t", "--threads", type=THREADS, default=0, envvar="EDGEMOE_THREADS")
@attention_options
@kld_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def perplexity(
    model: Path,
    input_path: Path,
    n_ctx: int,
    max_tokens: int | None,
    gating: Any,
    degrade_ratio: float | None,
    precalc_from: int | None,
    expert_slots: int | None,
    prompt_tokens: int | None,
    threads: int,
    attention: AttentionOptions,
    kld: KldOptions,
    as_json: bool,
) -> None:
    """Held-out NLL and perplexity through edgemoe, and the expert activations computed; with
    --kl-divergence-base / --kl-divergence, the KL divergence and top-token agreement against a base run.

    Gating and degradation apply to every scored token here (the text stands in for decode).
    """
    from dataclasses import replace

    from ..analysis.perplexity import perplexity as run_ppl
    from ..calibration.adaptive import build_gating
    from ..placement import gating_for
    from ..progress import progress_bar
    from ..runtime.engine import Engine, LoadConfig

    calibration = gating.calibration
    if precalc_from is not None:
        _precalc_perplexity(
            model, input_path, n_ctx, max_tokens, calibration, precalc_from,
            _precalc_slots(degrade_ratio, expert_slots), 32 if prompt_tokens is None else prompt_tokens,
            threads, attention, kld, as_json,
        )  # fmt: skip
        return
    skip = _scored_from(n_ctx, degrade_ratio, expert_slots, prompt_tokens)
    gate = replace(gating_for(gating, model), decode_only=False)
    text = input_path.read_text(encoding="utf-8", errors="replace")
    load = LoadConfig(
        n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads, **attention.load_kwargs()
    )
    with Engine(model, load) as eng:
        tokens = eng.tokenize(text, add_special=False)[:max_tokens]
        policy = build_gating(eng, gate)
        deg_policies = _degradation(model, eng, calibration, degrade_ratio, expert_slots, skip)
        policies: list[Any] = ([policy] if policy is not None else []) + deg_policies
        run = {
            "gating": gating.mode,
            "threshold": policy.threshold if policy is not None else None,
            "degrade": degrade_ratio,
            "expert_slots": expert_slots,
            "cache_type_k": attention.cache_type_k,
            "cache_type_v": attention.cache_type_v,
        }
        sink = kld_sink(kld, eng, tokens, ctx=n_ctx, score_from=skip, run=run)
        with progress_bar(len(tokens), "perplexity", unit="tok") as bar:
            res = run_ppl(eng, tokens, ctx=n_ctx, policies=policies, progress=bar, score_from=skip, rows=sink)
        flash_attn = eng.flash_attn  # what "auto" resolved to
    d = {
        "model": str(model),
        "input": str(input_path),
        **{k: run[k] for k in ("gating", "threshold")},
        # what calibration measured the threshold to cost on its validation text (None: a given threshold)
        "threshold_cost": dict(policy.calibrated) if policy is not None and policy.calibrated else None,
        "prompt_tokens": skip,
        "flash_attn": flash_attn,
        **{k: run[k] for k in ("cache_type_k", "cache_type_v")},
        **res.to_dict(),
    }
    deg = deg_policies[-1] if deg_policies else None
    _print_perplexity(d, res, deg, degrade_ratio, expert_slots, as_json, _kld_report(d, sink))


def _degradation(
    model: Path,
    eng: Any,
    calibration: Path | None,
    degrade_ratio: float | None,
    expert_slots: int | None,
    skip: int,
) -> list[Any]:
    """perplexity --degrade's route policies ([DAOP's residency, the degradation]; none without it)."""
    if degrade_ratio is None or expert_slots is None:
        return []
    from ..analysis.daop import daop_degradation
    from ..calibration.super_experts import protected_experts
    from ..placement import calibration_for

    cal = calibration_for(model, ("daop",), None, calibration, n_threads=eng.n_threads)
    assert cal is not None  # calibrated on first use when missing
    residency, deg = daop_degradation(
        eng,
        cal,
        slots=min(expert_slots, eng.info.n_expert),
        ratio=degrade_ratio,
        prompt_tokens=skip,
        protected=protected_experts(cal),
    )
    return [residency, deg]


def _kld_report(d: dict[str, Any], sink: Any) -> list[str]:
    """The KL-divergence sink's result into `d["kld"]` (the base written, or the comparison); its text lines."""
    if sink is None:
        return []
    d["kld"], lines = sink.report()
    return list(lines)


def _precalc_slots(degrade_ratio: float | None, expert_slots: int | None) -> int:
    """--precalc-from's slots per MoE layer: it takes --expert-slots, not --degrade."""
    if degrade_ratio is not None or expert_slots is None:
        raise click.UsageError(
            "--precalc-from takes --expert-slots (the experts outside the slots are pre-calculated), not --degrade"
        )
    return expert_slots


def _scored_from(
    n_ctx: int, degrade_ratio: float | None, expert_slots: int | None, prompt_tokens: int | None
) -> int:
    """The tokens of each chunk perplexity skips before it scores (--prompt-tokens, default 32 with
    --degrade, else 0), once the options are checked together."""
    if (degrade_ratio is None) != (expert_slots is None):
        raise click.UsageError(
            "--degrade and --expert-slots go together (degradation routes to the experts DAOP's slots hold)"
        )
    skip = prompt_tokens if prompt_tokens is not None else 32 if degrade_ratio is not None else 0
    if skip >= n_ctx - 1:
        raise click.UsageError(f"--prompt-tokens {skip} leaves nothing of a --ctx {n_ctx} chunk to score")
    if degrade_ratio is not None and skip < 1:
        raise click.UsageError("--degrade needs --prompt-tokens >= 1 (the prompt DAOP swaps by)")
    return skip


def _print_perplexity(
    d: dict[str, Any],
    res: Any,
    deg: Any,
    degrade_ratio: float | None,
    expert_slots: int | None,
    as_json: bool,
    kld_lines: list[str],
) -> None:
    """perplexity's result `d` (with the degradation `deg`'s report, if any) as JSON or as text (then the
    KL-divergence report's `kld_lines`)."""
    if deg is not None:
        d["degrade"] = {**deg.report(), "expert_slots": expert_slots}
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo(
        f"nll {res.nll:.4f}  ppl {res.ppl:.3f}  tokens {res.tokens}  expert activations "
        f"{res.expert_activations} of {res.full_activations} (reduction {res.activation_reduction:.1%})"
    )
    if deg is not None:
        click.echo(
            f"degradation r={degrade_ratio}: {deg.n_replaced} of {deg.n_cpu} CPU expert executions moved "
            f"to resident experts ({(deg.cpu_avoided or 0.0):.1%}), {expert_slots} slots per MoE layer"
        )
    if kld_lines:
        click.echo("\n".join(kld_lines))


def _precalc_perplexity(
    model: Path,
    input_path: Path,
    n_ctx: int,
    max_tokens: int | None,
    calibration: Path | None,
    first_layer: int,
    expert_slots: int,
    prompt_tokens: int,
    threads: int,
    attention: AttentionOptions,
    kld: KldOptions,
    as_json: bool,
) -> None:
    """perplexity --precalc-from: edgemoe.analysis.precalc_run over DAOP's placement (static, not swapped); the
    KL-divergence options take the run with the pre-calculation."""
    from ..analysis.precalc_run import precalc_run
    from ..placement import check_precalc_from, enable_static_placement
    from ..progress import progress_bar
    from ..runtime.engine import Engine, LoadConfig

    if prompt_tokens < 1 or prompt_tokens >= n_ctx - 1:
        raise click.UsageError(
            f"--prompt-tokens {prompt_tokens}: use 1..{n_ctx - 2} with --precalc-from (the prompt "
            "runs in one ubatch, the rest token by token)"
        )
    text = input_path.read_text(encoding="utf-8", errors="replace")
    load = LoadConfig(
        n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads, **attention.load_kwargs()
    )
    with Engine(model, load) as eng:
        check_precalc_from(eng.info, first_layer)
        enable_static_placement(eng, model, expert_slots, calibration)
        tokens = eng.tokenize(text, add_special=False)[:max_tokens]
        desc = {"precalc_from": first_layer, "expert_slots": expert_slots, **attention.load_kwargs()}
        sink = kld_sink(kld, eng, tokens, ctx=n_ctx, score_from=prompt_tokens, run=desc)
        with progress_bar(2 * len(tokens), "perplexity (without, with pre-calculation)", unit="tok") as bar:
            run = precalc_run(
                eng,
                tokens,
                ctx=n_ctx,
                prompt_tokens=prompt_tokens,
                first_layer=first_layer,
                progress=lambda k: bar(2 * k),
                rows=sink,
            )
    d = {
        "model": str(model),
        "input": str(input_path),
        "prompt_tokens": prompt_tokens,
        "expert_slots": expert_slots,
        "precalc": run.to_dict(),
    }
    kld_lines = _kld_report(d, sink)
    if as_json:
        click.echo(json.dumps(d))
        return
    st = run.stats
    share = st["early_share"]
    click.echo(
        f"nll {run.nll:.4f} with pre-calculation from layer {first_layer}, {run.nll_off:.4f} without "
        f"({run.nll_change:+.2%}), top-1 agreement {run.top1_agreement:.3f}, mean KLD {run.mean_kld:.5f} from the "
        f"run without it, {run.tokens} tokens"
    )
    click.echo(
        f"pre-calculated {st['used']} of {st['used'] + st['late']} CPU expert executions "
        f"({(share or 0.0):.1%}); {st['computed'] - st['used']} computed for nothing"
    )
    if kld_lines:
        click.echo("\n".join(kld_lines))
