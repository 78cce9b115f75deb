#!/usr/bin/env python3
"""Write a random-weight GGUF with the shapes of a real MoE model (see docs/synthetic-models.md).

    python tools/synth_gguf.py qwen3-30b-a3b --out /tmp/qwen3-30b-a3b-Q4_K.gguf
    python tools/synth_gguf.py tiny-qwen3moe --type Q8_0 --out /tmp/tiny.gguf
    python tools/synth_gguf.py --list
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from edgemoe.gguf.info import format_size
from edgemoe.gguf.presets import QTYPES
from edgemoe.gguf.synth import PRESETS, plan_tensors, write_synthetic


def _print_presets(qtype: str) -> None:
    click.echo(f"{'preset':18} {'arch':10} {'layers':>6} {'experts':>7} {'used':>4} {'n_embd':>6} {'size (' + qtype + ')':>14}")
    for p in PRESETS.values():
        size = sum(t.nbytes for t in plan_tensors(p, qtype=qtype))
        click.echo(f"{p.name:18} {p.arch:10} {p.n_layer:>6} {p.n_expert:>7} {p.n_expert_used:>4} {p.n_embd:>6} "
                   f"{format_size(size):>14}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("preset", required=False, type=click.Choice(sorted(PRESETS)))
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), help="Output .gguf path.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Keep only the first N layers.")
@click.option("--type", "qtype", type=click.Choice(QTYPES, case_sensitive=False), default="Q4_K", show_default=True,
              help="Type of the large matrices (norms and router stay F32).")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--list", "list_presets", is_flag=True, help="List the presets and their sizes, then exit.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--shape-only", is_flag=True,
              help="Tensor data as a sparse hole of zeros: the header for `edgemoe simulate`, not for running.")
def main(preset: str | None, out: Path | None, layers: int | None, qtype: str, seed: int, list_presets: bool,
         quiet: bool, shape_only: bool) -> None:
    """Write a random-weight GGUF of PRESET (speed/memory benchmarks only: routing is random)."""
    if list_presets:
        _print_presets(qtype.upper())
        return
    if preset is None or out is None:
        raise click.UsageError("give a PRESET and --out PATH (or --list)")
    try:
        path = write_synthetic(preset, out, layers=layers, qtype=qtype, seed=seed, progress=not quiet,
                               shape_only=shape_only)
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"wrote {path} ({format_size(path.stat().st_size)})")


if __name__ == "__main__":
    main()
