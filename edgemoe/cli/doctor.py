"""`edgemoe doctor`: the build, the devices, a load + 4 greedy tokens on each, the CLI's generate with an expert
cache on a 64+ token prompt, and the series' op cases; every step in a child process."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..analysis.doctor import format_report, run_doctor
from .model import BUNDLED_MODEL


@click.command()
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=BUNDLED_MODEL,
    show_default="the bundled fixture",
    help="GGUF to load in the checks",
)
@click.option(
    "--rpc",
    is_flag=True,
    help="also check llama.cpp's RPC device on loopback (a GPU stand-in on a machine without one)",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=180.0,
    show_default=True,
    help="seconds each step may take before it is killed and reported as a hang",
)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON (for tools and bug reports)")
def doctor(model_path: Path, rpc: bool, timeout: float, as_json: bool) -> None:
    """Check this machine and build: what you run first, and what you paste into a bug report.

    Prints the build (CPU or CUDA and its architectures, patch level, ggml), the devices ggml sees (free and
    total memory, CUDA driver and runtime, PCIe link), RAM and CPU. Then, each in a child process with a
    timeout, it loads the model on the CPU and with 0 and all layers on each GPU, generates 4 greedy tokens and
    compares them with the CPU's; runs `edgemoe generate` on a 64+ token prompt with an expert cache of 2 slots
    per MoE layer on the GPU (the RPC device with --rpc) and compares its tokens with a plain CPU run's; and
    runs the series' test-backend-ops cases on each GPU (the CPU without one); and runs each GPU's id-row
    self-test again, showing the mode engines will use there (raw: skipped experts' ids reach the GPU as -1;
    fill: a CPU round trip per layer; EDGEMOE_DEVICE_IDS=raw|fill overrides it). A crash or a hang is reported
    as that step's failure. Exits 1 when a step fails, naming the first.
    """
    report = run_doctor(model_path, rpc=rpc, timeout=timeout)
    click.echo(json.dumps(report.to_json(), indent=1) if as_json else format_report(report))
    if not report.ok:
        raise SystemExit(1)
