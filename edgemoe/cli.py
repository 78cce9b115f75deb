"""edgemoe command line: a thin click layer over edgemoe's Python API."""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import EdgeMoeError, InvalidSizeError

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


class GGUFPath(click.ParamType):
    """A path to a GGUF model; validated (exists, GGUF, complete, known architecture) at parse time."""

    name = "MODEL.gguf"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from .gguf_info import check_gguf

        path = Path(value)
        try:
            check_gguf(path)
        except EdgeMoeError as err:  # one line, no usage text: the path was fine, the file is not
            raise click.ClickException(str(err)) from err
        return path


class Size(click.ParamType):
    """A byte size such as 6GiB, 8GB or 512MiB."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from .gguf_info import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value, option=f"--{param.name}" if param else "size")
        except InvalidSizeError as err:
            self.fail(str(err), param, ctx)


class EdgeMoeGroup(click.Group):
    """Turns library errors into one-line messages; tracebacks only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgeMoeError as err:
            if ctx.meta.get("edgemoe.debug"):
                traceback.print_exc()
            raise click.ClickException(str(err)) from err
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 - the CLI edge: never show a raw traceback by default
            if ctx.meta.get("edgemoe.debug"):
                raise
            raise click.ClickException(
                f"unexpected {type(err).__name__}: {err} (run `edgemoe --debug ...` for the traceback "
                "and please report it)") from err


def _run_options(f: Any) -> Any:
    opts = [
        click.option("--temp", "temperature", type=float, default=0.8, show_default=True,
                     help="sampling temperature; 0 = greedy (identical to stock llama.cpp)"),
        click.option("--top-k", type=int, default=40, show_default=True),
        click.option("--top-p", type=float, default=0.95, show_default=True),
        click.option("--min-p", type=float, default=0.05, show_default=True),
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=None, help="sampling seed (default: random)"),
        click.option("-t", "--threads", type=click.IntRange(min=0), default=0,
                     help="CPU threads (default: physical cores)", envvar="EDGEMOE_THREADS"),
        click.option("--ctx", "n_ctx", type=click.IntRange(min=0), default=0,
                     help="context length (default: the model's, at most 4096)"),
        click.option("-ngl", "--gpu-layers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="layers stock llama.cpp offloads whole to the GPU (CUDA builds)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _gating_options(f: Any) -> Any:
    opts = [
        click.option("--gating", type=click.Choice(["off", "fisher", "empirical", "score", "ser"]), default="off",
                     show_default=True, help="adaptive top-k: drop experts a token does not need (docs/gating.md)"),
        click.option("--threshold", type=float, default=None, help="the gating rule's threshold"),
        click.option("--target-reduction", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
                     default=None, help="find the threshold that drops this share of expert activations "
                                        "(on the calibration's validation text), e.g. 0.25"),
        click.option("--calibration", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="calibration directory (default: the model's, see docs/predictors.md)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _gating(model: Path, gating: str, threshold: float | None, target_reduction: float | None,
            calibration: Path | None, *, decode_only: bool) -> Any:
    from .adaptive import GatingOptions

    if calibration is None:
        from .adaptive import default_calibration_dir

        calibration = default_calibration_dir(model)
    return GatingOptions(mode=gating, threshold=threshold, target_reduction=target_reduction,
                         calibration=calibration, decode_only=decode_only)


def _install_gating(engine: Any, opts: Any) -> None:
    from .adaptive import build_gating

    policy = build_gating(engine, opts)
    if policy is not None:
        engine.set_policies([policy])
        click.echo(f"gating: {opts.mode}, threshold {policy.threshold:.4g}"
                   + (" (prefill at full top-k)" if opts.decode_only else ""), err=True)


def _make_sampling(temperature: float, top_k: int, top_p: float, min_p: float,
                   repeat_penalty: float, seed: int | None) -> Any:
    from .sampling import DEFAULT_SEED, SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=DEFAULT_SEED if seed is None else seed)


def _open_engine(model: Path, threads: int, n_ctx: int, gpu_layers: int) -> Any:
    from .engine import Engine, LoadConfig

    engine = Engine(model, LoadConfig(n_threads=threads, n_ctx=n_ctx, n_gpu_layers=gpu_layers))
    if not engine.info.is_moe:
        click.echo(f"note: {model.name} is a dense model (no routed experts); edgemoe's MoE "
                   "features are off and it runs as stock llama.cpp", err=True)
    return engine


@click.group(cls=EdgeMoeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgemoe")
@click.option("--debug", is_flag=True, envvar="EDGEMOE_DEBUG",
              help="show llama.cpp's log and full tracebacks")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """edgemoe: run GGUF Mixture-of-Experts models fast on a CPU + GPU."""
    ctx.meta["edgemoe.debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        logging.getLogger("edgemoe.llama_cpp").setLevel(logging.CRITICAL)


@cli.command()
@click.argument("model", type=GGUFPath())
@click.option("--vram", type=Size(), default=None, help="show what a GPU budget like 8GiB can hold")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=0), default=0,
              help="context length for the KV-cache estimate (default: the model's, at most 4096)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect(model: Path, vram: int | None, n_ctx: int, as_json: bool) -> None:
    """Show a model's architecture, experts and where its bytes are."""
    from .gguf_info import info_to_dict, read_model_info, vram_plan
    from .report import format_info, format_plan, plan_to_dict

    info = read_model_info(model)
    n_ctx = n_ctx or min(info.n_ctx_train or 4096, 4096)
    plan = vram_plan(info, vram, n_ctx=n_ctx) if vram is not None else None
    if as_json:
        d = info_to_dict(info)
        if plan is not None:
            d["vram_plan"] = plan_to_dict(plan)
        click.echo(json.dumps(d, indent=1))
        return
    click.echo(format_info(info))
    if plan is not None:
        click.echo(format_plan(plan))


@cli.command()
@click.argument("model", type=GGUFPath())
@click.option("-p", "--prompt", required=True, help="prompt text ('-' reads it from stdin)")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@_run_options
@_gating_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with ids and timings")
def generate(model: Path, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
             min_p: float, repeat_penalty: float, seed: int | None, threads: int, n_ctx: int,
             gpu_layers: int, gating: str, threshold: float | None, target_reduction: float | None,
             calibration: Path | None, as_json: bool) -> None:
    """Complete a prompt (plain text streamed to stdout, or --json)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    sampling = _make_sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    gate = _gating(model, gating, threshold, target_reduction, calibration, decode_only=True)
    with _open_engine(model, threads, n_ctx, gpu_layers) as engine:
        _install_gating(engine, gate)
        if as_json:
            g = engine.generate(prompt, max_tokens=max_tokens, sampling=sampling)
            click.echo(json.dumps({"model": str(model), "text": g.text, "prompt_tokens": g.prompt_tokens,
                                   "tokens": g.tokens, "stop_reason": g.stop_reason,
                                   "n_threads": engine.n_threads, "timings": g.timings.to_dict()}))
            return
        for _, piece in engine.stream(prompt, max_tokens=max_tokens, sampling=sampling):
            click.echo(piece, nl=False)
        click.echo()
        click.echo(_stats_line(engine.last.timings), err=True)


def _stats_line(t: Any) -> str:
    return (f"[prompt {t.prompt_tokens} tok, {t.prompt_tps:.1f} tok/s | "
            f"decode {t.decode_tokens} tok, {t.decode_tps:.1f} tok/s | ttft {t.ttft_s * 1000:.0f} ms]")


@cli.command()
@click.argument("model", type=GGUFPath(), required=False)
@click.option("--system", default=None, help="system prompt")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="most tokens per reply")
@_run_options
@_gating_options
def chat(model: Path | None, system: str | None, max_tokens: int, temperature: float, top_k: int,
         top_p: float, min_p: float, repeat_penalty: float, seed: int | None, threads: int,
         n_ctx: int, gpu_layers: int, gating: str, threshold: float | None, target_reduction: float | None,
         calibration: Path | None) -> None:
    """Chat with a model (default: the bundled fixture). /reset clears history, /quit leaves.

    When stdin is not a terminal, each non-empty input line is one user message.
    """
    from .engine import ChatSession

    if model is None:
        model = GGUFPath().convert(os.environ.get("EDGEMOE_MODEL", str(BUNDLED_MODEL)), None, None)
    sampling = _make_sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    gate = _gating(model, gating, threshold, target_reduction, calibration, decode_only=True)
    interactive = sys.stdin.isatty()
    with _open_engine(model, threads, n_ctx, gpu_layers) as engine:
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
            for piece in session.send(text, max_tokens=max_tokens, sampling=sampling):
                click.echo(piece, nl=False)
            click.echo()
            click.echo(_stats_line(engine.last.timings), err=True)


def main() -> None:
    cli(prog_name="edgemoe")


@cli.command()
@click.argument("model", type=GGUFPath())
@click.option("--input", "input_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="text file to run through the model")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="trace file to write (.npz); written only when complete")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="trace at most this many tokens of the input")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=512, show_default=True,
              help="tokens per sequence: the input is cut into chunks of this size")
@click.option("--mode", type=click.Choice(["prefill", "decode"]), default="prefill", show_default=True,
              help="prefill: each chunk in one prefill; decode: a short prefill, then one token per decode")
@click.option("--prefill-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="with --mode decode: tokens prefilled before decoding starts")
@click.option("--gate-inputs", is_flag=True, help="also record the router inputs (hidden states, float16)")
@click.option("--probs", is_flag=True, help="also record the full router probabilities")
@click.option("-t", "--threads", type=click.IntRange(min=0), default=0, envvar="EDGEMOE_THREADS")
def trace(model: Path, input_path: Path, out_path: Path, max_tokens: int, n_ctx: int, mode: str,
          prefill_tokens: int, gate_inputs: bool, probs: bool, threads: int) -> None:
    """Record which experts every MoE layer picks for every token of a text."""
    from .engine import Engine, LoadConfig
    from .progress import progress_bar
    from .trace import record_trace

    text = input_path.read_text(encoding="utf-8", errors="replace")
    with Engine(model, LoadConfig(n_ctx=n_ctx, n_threads=threads)) as eng:
        if not eng.info.is_moe:
            raise click.ClickException(f"{model.name} is a dense model: there are no experts to trace")
        tokens = eng.tokenize(text)[:max_tokens]
        with progress_bar(len(tokens), "trace", unit="tok") as bar:
            tr = record_trace(eng, tokens, ctx=n_ctx, mode=mode, prefill_tokens=prefill_tokens,
                              probs=probs, gate_inputs=gate_inputs, progress=bar)
    tr.meta["input"] = str(input_path)
    tr.save(out_path)
    click.echo(f"wrote {out_path}: {tr.n_tokens} tokens x {len(tr.layers)} MoE layers x top-{tr.ids.shape[2]} "
               f"({mode})", err=True)


@cli.command()
@click.argument("model", type=GGUFPath())
@click.option("-t", "--threads", type=click.IntRange(min=0), default=0, envvar="EDGEMOE_THREADS")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def verify(model: Path, threads: int, as_json: bool) -> None:
    """Check that edgemoe's MoE hook reproduces stock llama.cpp on MODEL (exit 1 if a check fails)."""
    from .verify import run_checks

    results = run_checks(model, threads=threads)
    ok = all(r.ok for r in results)
    if as_json:
        click.echo(json.dumps({"model": str(model), "ok": ok, "checks": [r.to_dict() for r in results]}))
    else:
        for r in results:
            click.echo(f"{'PASS' if r.ok else 'FAIL'}  {r.name:<10} {r.detail}")
    if not ok:
        raise SystemExit(1)


@cli.command("trace-stats")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", type=GGUFPath(), default=None,
              help="the GGUF the trace came from (default: the path in the trace), for gate-reuse accuracy")
@click.option("--window", type=click.IntRange(min=2), default=32, show_default=True,
              help="tokens per window for the high-workload adjacency")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="write PNG figures into this directory")
def trace_stats(trace_path: Path, model: Path | None, window: int, as_json: bool, plots_dir: Path | None) -> None:
    """Routing statistics of a trace: frequency, locality, similarity, gate reuse, LRU hit rates."""
    from .report import format_stats
    from .trace import Trace
    from .trace_stats import compute_stats, load_routers

    tr = Trace.load(trace_path)
    routers = None
    if tr.gate_inputs is not None:
        src = model or Path(str(tr.meta.get("model", "")))
        if src.is_file():
            routers = load_routers(str(src), [int(x) for x in tr.layers])
    st = compute_stats(tr, routers=routers, window=window)
    d = st.to_dict()
    d["trace"] = {"path": str(trace_path), "tokens": tr.n_tokens, "mode": tr.meta.get("mode"),
                  "model": tr.meta.get("model"), "input": tr.meta.get("input")}
    if plots_dir is not None:
        from .trace_plots import write_plots

        d["plots"] = [str(p) for p in write_plots(st, plots_dir, Path(str(tr.meta.get("model", "trace"))).stem)]
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo(format_stats(d))



@cli.command()
@click.argument("model", type=GGUFPath())
@click.option("--input", "input_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="text to score (use held-out text)")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=512, show_default=True,
              help="tokens per chunk; each chunk is a fresh sequence")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="score at most this many tokens")
@_gating_options
@click.option("-t", "--threads", type=click.IntRange(min=0), default=0, envvar="EDGEMOE_THREADS")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def perplexity(model: Path, input_path: Path, n_ctx: int, max_tokens: int | None, gating: str,
               threshold: float | None, target_reduction: float | None, calibration: Path | None, threads: int,
               as_json: bool) -> None:
    """Held-out NLL and perplexity through edgemoe, and the expert activations computed.

    Gating applies to every token here (the text stands in for decode).
    """
    from .adaptive import build_gating
    from .engine import Engine, LoadConfig
    from .perplexity import perplexity as run_ppl
    from .progress import progress_bar

    gate = _gating(model, gating, threshold, target_reduction, calibration, decode_only=False)
    text = input_path.read_text(encoding="utf-8", errors="replace")
    with Engine(model, LoadConfig(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads)) as eng:
        tokens = eng.tokenize(text, add_special=False)[:max_tokens]
        policy = build_gating(eng, gate)
        policies = [policy] if policy is not None else []
        with progress_bar(len(tokens), "perplexity", unit="tok") as bar:
            res = run_ppl(eng, tokens, ctx=n_ctx, policies=policies, progress=bar)
    d = {"model": str(model), "input": str(input_path), "gating": gating,
         "threshold": policy.threshold if policy is not None else None, **res.to_dict()}
    if as_json:
        click.echo(json.dumps(d))
    else:
        click.echo(f"nll {res.nll:.4f}  ppl {res.ppl:.3f}  tokens {res.tokens}  expert activations "
                   f"{res.expert_activations} of {res.full_activations} (reduction {res.activation_reduction:.1%})")
