"""`edgemoe calibrate` and `edgemoe predict-eval`: thin click commands over edgemoe.calibration and
edgemoe.predictors (registered by edgemoe.cli.main)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ..calibration.run import DEFAULT_CTX, DEFAULT_TOKENS
from .options import AttentionOptions, attention_options
from .types import THREADS, GGUFPath, OutputPath


@click.command()
@click.argument("model", type=GGUFPath())
@click.option(
    "--corpus",
    "corpora",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="corpus text file, repeatable; only its train split (the first 90%) is read",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=64),
    default=DEFAULT_TOKENS,
    show_default=True,
    help="calibration trace tokens, split evenly over the corpora",
)
@click.option(
    "--out",
    "out_dir",
    type=OutputPath(directory=True),
    default=None,
    help="calibration directory to write (default: the per-user cache for this model file)",
)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=16),
    default=DEFAULT_CTX,
    show_default=True,
    help="tokens per traced sequence",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="train/validation split and training seed"
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=None,
    help="most training epochs of the learned predictors (default 40, early stopping)",
)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    help="run only this stage (repeatable; the stages it needs run too), e.g. --stage predictors",
)
@click.option("--force", is_flag=True, help="replace an existing calibration directory")
@click.option(
    "--update",
    is_flag=True,
    help="run only the --stage stages into an existing directory, keeping the others (same model, "
    "corpora, --tokens, --ctx, --seed)",
)
@click.option(
    "-t",
    "--threads",
    type=THREADS,
    default=0,
    envvar="EDGEMOE_THREADS",
    help="CPU threads for llama.cpp and torch (default: physical cores)",
)
@click.option("--json", "as_json", is_flag=True, help="print card.json")
def calibrate(
    model: Path,
    corpora: tuple[Path, ...],
    tokens: int,
    out_dir: Path | None,
    n_ctx: int,
    seed: int,
    epochs: int | None,
    stages: tuple[str, ...],
    force: bool,
    update: bool,
    threads: int,
    as_json: bool,
) -> None:
    """Record calibration traces on the corpora's train splits and train the expert predictors."""
    from ..analysis.predictor_eval import format_evaluation
    from ..calibration.run import CalibrationConfig, run_calibration

    options = {"predictors": {"epochs": epochs}} if epochs else {}
    cfg = CalibrationConfig(
        model=model,
        corpora=corpora,
        tokens=tokens,
        ctx=n_ctx,
        seed=seed,
        n_threads=threads,
        stages=stages or None,
        options=options,
    )
    cal = run_calibration(cfg, out_dir, force=force, update=update)
    if as_json:
        click.echo(json.dumps(cal.card, indent=1))
        return
    card = cal.card
    took = ", ".join(f"{k} {card['elapsed_s'][k]:.0f} s" for k in _ran(card, stages))
    click.echo(
        f"wrote {cal.path}: {card.get('traces', {}).get('tokens', 0)} calibration tokens ({took})", err=True
    )
    if "predictors" in card:
        click.echo("validation (held-back 10% of the calibration sequences):")
        click.echo(format_evaluation(card["predictors"]["validation"]))


def _ran(card: Mapping[str, Any], stages: tuple[str, ...]) -> list[str]:
    """The stages this run executed: all, or those of --stage."""
    return [k for k in card["elapsed_s"] if not stages or k in stages]


@click.command("predict-eval")
@click.argument("model", type=GGUFPath())
@click.option(
    "--calibration",
    "calibration_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="calibration directory (default: bundled for the fixtures, else the per-user cache)",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="text the predictors never saw",
)
@click.option("--heldout", is_flag=True, help="use only the held-out split (last 10%) of --input")
@click.option("--max-tokens", type=click.IntRange(min=64), default=8192, show_default=True)
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=16),
    default=DEFAULT_CTX,
    show_default=True,
    help="tokens per sequence",
)
@click.option(
    "--window",
    type=click.IntRange(min=2),
    default=32,
    show_default=True,
    help="ubatch size (tokens) for the high-workload recall",
)
@click.option("--kind", "kinds", multiple=True, help="evaluate only this predictor kind (repeatable)")
@click.option("-t", "--threads", type=THREADS, default=0, envvar="EDGEMOE_THREADS")
@attention_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='print {kind: {"d1": {"recall": r, ..., "per_layer": {...}}, "d2": {...}}}',
)
def predict_eval(
    model: Path,
    calibration_dir: Path | None,
    input_path: Path,
    heldout: bool,
    max_tokens: int,
    n_ctx: int,
    window: int,
    kinds: tuple[str, ...],
    threads: int,
    attention: AttentionOptions,
    as_json: bool,
) -> None:
    """Score every expert predictor on a text: recall, top-(k+m) recall, exact set, high-workload recall."""
    from ..analysis.predictor_eval import evaluate, evaluation_to_json, format_evaluation
    from ..calibration.card import find_calibration
    from ..calibration.corpus import split_corpus
    from ..calibration.traces import eval_tokens, record_eval_trace
    from ..predictors import parse_kind
    from ..progress import progress_bar
    from ..runtime.engine import Engine, LoadConfig

    for k in kinds:
        parse_kind(k)
    cal = find_calibration(model, calibration_dir)
    calibrated_on = {Path(c["path"]).resolve() for c in cal.card.get("corpus", [])}
    if input_path.resolve() in calibrated_on and not heldout:
        click.echo(
            f"warning: {cal.path} was calibrated on the train split of {input_path.name}; "
            "pass --heldout to score its held-out split only",
            err=True,
        )
    text = (
        split_corpus(input_path).heldout_text()
        if heldout
        else input_path.read_text("utf-8", errors="replace")
    )
    preds = cal.predictors(model, kinds=kinds or None)
    with Engine(model, LoadConfig(n_ctx=n_ctx, n_threads=threads, **attention.load_kwargs())) as eng:
        n_tokens = len(eval_tokens(eng, text, ctx=n_ctx, max_tokens=max_tokens))
        with progress_bar(n_tokens, "trace", unit="tok") as bar:
            tr = record_eval_trace(eng, text, ctx=n_ctx, max_tokens=max_tokens, progress=bar)
    ev = evaluate(preds, tr, window=window)
    if as_json:
        click.echo(json.dumps(evaluation_to_json(ev)))
        return
    click.echo(
        f"{model.name} on {input_path.name}{' (held-out split)' if heldout else ''}: {tr.n_tokens} tokens, "
        f"calibration {cal.path} ({cal.source})",
        err=True,
    )
    click.echo(format_evaluation(ev))
