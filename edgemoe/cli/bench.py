"""`edgemoe bench`: stock placements vs the expert cache at one VRAM budget (edgemoe.perf.bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..placement import calibration_for, check_precalc_from
from ..policies.registry import benched_policies, compared_policies
from .cache_options import ALLOC_HELP
from .options import AttentionOptions, attention_options, option_group, speculation_options
from .types import THREADS, GGUFPath, OutputPath, PolicyName, Size


def _run_options(f: Any) -> Any:
    """What every row runs: the budget, the prompt and the generated tokens, the threads, the context and the
    ubatch; given to the command as `run` (BenchSpec's fields)."""
    return option_group("run", [
        click.option("--vram", type=Size(auto=True), default="8GiB", show_default=True,
                     help="GPU budget shared by every configuration (auto: this GPU's free memory)"),
        click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True,
                     help="prompt length: prefill t/s and TTFT, and the TTFT of a second request on the same prefix "
                     "('reuse ms': its KV state restored from host memory, as serve's prompt cache does)"),
        click.option("--gen-tokens", type=click.IntRange(min=2), default=64, show_default=True),
        click.option("-t", "--threads", type=THREADS, default=0, help="CPU threads (default: physical cores)"),
        click.option("-ub", "--ubatch", "n_ubatch", type=click.IntRange(min=1), default=None,
                     help="every row's prefill ubatch (default: on a GPU with a GPU --profile, stock rows at stock's "
                     "fastest -ub and +device prefill rows at edgemoe's planned one, as `edgemoe plan "
                     "--prompt-tokens` projects them for the prompt; else 512); the 'ub' column says what each row "
                     "ran, and each row is projected at its own"),
        click.option("--ctx", "n_ctx", type=click.IntRange(min=0), default=0,
                     help="every row's context (the KV cache each allocates; default 0: the prompt and the "
                     "generated tokens, rounded up to 256)"),
    ], lambda **kw: kw)(f)  # fmt: skip


def _row_options(f: Any) -> Any:
    """Which rows run: the policies and their allocation, and the variants each policy runs again; given to the
    command as `rows` (BenchSpec's fields)."""
    return option_group("rows", [
        click.option("--policy", "policies", multiple=True, type=PolicyName(benched_policies), default=None,
                     help="edgemoe policies to run (repeatable; default: "
                     + ", ".join(compared_policies()) + ")"),
        click.option("--alloc", type=click.Choice(["equal", "dp"]), default=None, help=ALLOC_HELP),
        click.option("--calibration", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="calibration directory for the static policy and dp allocation (default: the model's)"),
        click.option("--compare-overlap", is_flag=True,
                     help="also run each policy with CPU/GPU overlap off (rows ending in 'no-overlap')"),
        click.option("--assign", type=click.Choice(["ratio", "greedy"]), default=None,
                     help="also run the policies that take an assigner (lru, dali) with this CPU/GPU assigner "
                     "('... +assign' rows; generate --assign), priced by --profile, which must have a GPU"),
        click.option("--device-prefill", type=click.IntRange(min=0), default=0, metavar="N",
                     help="also run each policy with prefill ubatches of N+ tokens on the GPU ('... +device prefill' "
                     "rows; generate --device-prefill), its slots leaving room for the two prefill buffers"),
        click.option("--device-prefill-borrow", is_flag=True,
                     help="with --device-prefill, also run each policy with the prefill buffers in borrowed slots "
                     "('... +device prefill borrow' rows; generate --device-prefill-borrow), every slot of the "
                     "budget kept"),
        click.option("--precalc-from", type=click.IntRange(min=1), default=None, metavar="L",
                     help="also run each policy with DAOP's pre-calculation from layer L ('... +precalc L' rows; "
                     "generate --precalc-from), projected at the rates each row measures"),
        click.option("--context-tiers", is_flag=True,
                     help="also run each policy's first row with its context created in steps (generate's default "
                     "with --vram; '... +tiers' rows): the smallest of the plan's steps that holds the tokens, with "
                     "that step's slots; rows only where --ctx leaves a step below it"),
    ], lambda **kw: kw)(f)  # fmt: skip


@click.command()
@click.argument("model", type=GGUFPath())
@_run_options
@_row_options
@click.option(
    "--profile",
    "profile_path",
    default=None,
    help="machine profile for the projection printed beside each row (default: this machine's, "
    "if `edgemoe profile` has written one; 'none' turns projections off)",
)
@attention_options
@speculation_options
@click.option(
    "--kld",
    "kld_base",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    metavar="BASE",
    help="add the KL divergence and same-top rate against BASE (`edgemoe perplexity MODEL --input TEXT "
    "--kl-divergence-base BASE`) of each row that changes the output: +precalc, a quantized KV cache",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plot", type=OutputPath(), default=None, help="write a PNG bar chart")
def bench(
    model: Path,
    run: dict[str, Any],
    rows: dict[str, Any],
    profile_path: str | None,
    attention: AttentionOptions,
    speculation: Any,
    kld_base: Path | None,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Prefill/decode tokens/s, TTFT, TPOT and VRAM: stock -ot exps=CPU, the best --n-cpu-moe, edgemoe policies."""
    from ..perf.bench.records import BenchResult
    from ..perf.bench.report import format_json, format_table
    from ..perf.bench.report import plot as plot_png
    from ..perf.bench.rows import BenchSpec
    from ..perf.bench.run import run_bench
    from ..perf.measure.profiling import default_profile_path

    policies = rows.pop("policies") or compared_policies()
    if rows["precalc_from"] is not None:
        from ..gguf.info import read_model_info

        check_precalc_from(read_model_info(model), rows["precalc_from"])
    if profile_path is None:
        profile = default_profile_path() if default_profile_path().exists() else None
    else:
        profile = None if profile_path == "none" else Path(profile_path)
    calibration = calibration_for(
        model, policies, rows["alloc"], rows.pop("calibration"), n_threads=run["threads"]
    )
    spec = BenchSpec(
        **run, **rows, policies=policies, calibration=calibration, profile=profile, **attention.load_kwargs(),
        speculation=speculation if speculation.on else None, kld_base=kld_base,
    )  # fmt: skip
    res: BenchResult = run_bench(
        model, spec, progress=lambda name: click.echo(f"running {name} ...", err=True)
    )
    if plot is not None:
        plot_png(res, plot)
    click.echo(format_json(res) if as_json else format_table(res))
