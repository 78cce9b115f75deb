"""The expert cache's options (--vram, --expert-slots, --policy, --alloc, ...) as one group: a command gets one
checked edgemoe.placement.CacheRequest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..plan.request import CacheRequest, cache_request
from ..policies.registry import policy_names, policy_spec
from .flags import ALIASES, as_flags
from .options import option_group
from .types import PolicyName, Size


def policy_help() -> str:
    """--policy's help: each registered policy's clause (its spec's help), then what they share."""
    specs = [policy_spec(n) for n in policy_names()]
    native = [s.name for s in specs if s.native is not None]
    calibrating = [s.name for s in specs if s.stages] + ["dali with --dali-prefetch"]
    flags = {o.keyword: "--" + o.keyword.replace("_", "-") for s in specs for o in s.options} | dict(ALIASES)
    return (
        "which experts the slots hold: "
        + ", ".join(f"{s.name} ({as_flags(s.help, flags)})" for s in specs)
        + f"; {_listed(native)} run inside llama.cpp's graph without stopping. {_listed(calibrating)} calibrate "
        "a model without calibration data on first use. Default: static (projected 1.44x stock's best decode at "
        "8 GiB on the bundled routing profiles of real models, daop 1.46x, dali 1.05x, lru 0.95x: "
        "docs/expert-cache.md), or the policy the other options belong to: dali with --dali-window, "
        "--dali-update or --dali-prefetch, promoe with --prefetch-distance or --prefetch-extra, lru with "
        "--assign or --blocking-loads"
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


ALLOC_HELP = (
    "slots per MoE layer: equal, or dp (AdapMoE's DP allocation: the same total, split to minimise "
    "the policy's misses replayed on the calibration's routing trace; --expert-slots N is then the "
    "average). Default: dp when the calibration has a routing trace, else equal"
)


def cache_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The cache's options, given to the command as `cache`: a CacheRequest (not enabled without a budget).

    Long because the option stack is declarative: one click.option per flag with its help, read top to bottom.
    """
    opts = [
        click.option(
            "--vram",
            type=Size(auto=True),
            default=None,
            help="GPU budget, e.g. 6GiB (auto: the GPU's free memory now): dense weights and KV cache "
            "first, the rest as expert slots (split over the MoE layers as --alloc says); a budget "
            "that holds the whole model runs it on the GPU as stock llama.cpp does, without an expert "
            "cache",
        ),
        click.option(
            "--expert-slots",
            type=click.IntRange(min=0),
            default=None,
            help="expert slots per MoE layer (instead of --vram; with --alloc dp the average)",
        ),
        click.option("--policy", type=PolicyName(), default=None, help=policy_help()),
        click.option("--alloc", type=click.Choice(["equal", "dp"]), default=None, help=ALLOC_HELP),
        click.option(
            "--dali-window",
            type=click.IntRange(min=1),
            default=None,
            help="dali: tokens per window (the paper's w; default 4)",
        ),
        click.option(
            "--dali-update",
            type=click.IntRange(min=1),
            default=None,
            help="dali: most experts replaced per window (the paper's u; default: experts per "
            "layer / 8, rounded up)",
        ),
        click.option(
            "--dali-prefetch",
            type=click.IntRange(min=0),
            default=None,
            help="dali: also prefetch, at each MoE layer, the N experts of the next one that DALI's "
            "residual predictor expects most tokens to use (the paper's prefetch size: 1 for 8 "
            "experts, 4 for more; calibrates on first use; runs in the routing hook: a host sync "
            "per MoE layer). Default 0: replacement only, inside llama.cpp",
        ),
        click.option(
            "--prefetch-distance",
            type=click.IntRange(min=1),
            default=None,
            help="promoe: predict the experts of the MoE layer this many layers ahead (default 2, "
            "ProMoE's stride; 1: the next layer)",
        ),
        click.option(
            "--prefetch-extra",
            type=click.IntRange(min=0),
            default=None,
            help="promoe: prefetch the top k + M predicted experts (default 1)",
        ),
        click.option(
            "--assign",
            type=click.Choice(["ratio", "greedy"]),
            default=None,
            help="lru, dali: at every MoE layer and step, load the misses a CPU/GPU assigner puts on "
            "the GPU before the layer runs (the others run on the CPU and load for the next "
            "step), minimising max(CPU time, GPU time + copies) by --profile's costs: ratio (the "
            "best cut, within 5% of the optimum) or greedy (DALI's). Runs in the routing hook: a "
            "host sync per MoE layer",
        ),
        click.option(
            "--profile",
            default=None,
            help="--assign's machine profile, and with --vram the one the prefill ubatch is planned on (-ub): "
            "a bundled name (rtx4060-laptop, rtx4090-desktop, "
            "h100-server, and the backtest's machines: docs/research/performance-model.md) or a file; "
            "default: this machine's (`edgemoe profile`)",
        ),
        click.option(
            "--degrade",
            type=click.FloatRange(0.0, 1.0, min_open=True),
            default=None,
            metavar="R",
            help="DAOP's graceful degradation: in decode, a token's expert that is not resident (not its "
            "best) is replaced by the best resident one it did not select whose router score is at "
            "least R times its own (e.g. 0.8). Fewer CPU experts for a small quality cost "
            "(docs/research/daop.md); changes the output; runs in the routing hook",
        ),
        click.option(
            "--device-prefill",
            type=click.IntRange(min=0),
            default=0,
            metavar="N",
            help="prefill ubatches of N or more tokens (e.g. 32) also run each cached layer's other "
            "experts on the GPU, from two buffers of a whole layer's experts (taken from --vram) "
            "that the next cached layer's experts copy into while this one computes. Stops at "
            "each cached layer of a prefill ubatch. Default 0: off (they run on the CPU, or "
            "llama.cpp's op offload copies them)",
        ),
        click.option(
            "--device-prefill-ahead",
            type=click.Choice(["all", "predicted", "routed"]),
            default="all",
            help="with --device-prefill, what copies one cached layer ahead: all (the next layer's "
            "experts outside its slots), predicted (those promoe's in-graph predictor names), routed "
            "(nothing: each layer copies what it routes, the GPU waiting)",
        ),
        click.option(
            "--device-prefill-borrow",
            is_flag=True,
            help="with --device-prefill, its two buffers borrow the slots of the last cached layers while a "
            "prompt is prefilled instead of coming out of --vram beside the slots (about two layers of "
            "experts more slots in decode); those layers are refilled after the prompt with the experts it "
            'routed most (docs/expert-cache.md, "Borrowing the slots")',
        ),
        click.option(
            "--precalc-from",
            type=click.IntRange(min=1),
            default=None,
            metavar="L",
            help="DAOP's pre-calculation: in decode, each cached MoE layer from layer L on has its experts "
            "predicted at the layer before by its own router on that layer's input; the predicted "
            "ones outside its slots run on the CPU on that input while the GPU computes the layer's "
            "attention, and it takes their results (approximate: changes the output; the paper "
            "starts at a quarter of the depth; docs/research/daop.md). Projected slower than without "
            "it: 0.92-1.01x daop's decode from the last 3/8 of the layers, 0.77-0.98x from "
            "layer 1, on the bundled GPU profiles at 8 GiB (docs/research/performance-model.md). Needs "
            "the cache's tables: not with --degrade, --assign, --blocking-loads or "
            "--dali-prefetch. Default: off",
        ),
        click.option(
            "--context-tiers/--no-context-tiers",
            default=True,
            help="with --vram: create the context at the smallest of 4096, 16384, 32768, 65536, 131072 tokens (below "
            "--ctx) that holds the conversation, the KV bytes the larger context would take as extra expert "
            "slots, and re-create it a step larger (fewer slots; the KV copied over) as the conversation "
            'grows. Same output; a pause at each step (docs/expert-cache.md, "Context tiers"). Default: '
            "on",
        ),
        click.option(
            "--blocking-loads",
            is_flag=True,
            help="lru, dali, daop, promoe: load a missed expert before its layer runs instead of running "
            "it on the CPU (needs the routing callback: a host sync per MoE layer); static and manual load "
            "no miss and refuse it",
        ),
    ]
    return option_group("cache", opts, _request)(f)


def _request(*, blocking_loads: bool, **given: Any) -> CacheRequest:
    return cache_request(blocking=blocking_loads, **given)  # a PlacementError is a usage error (cli.main)
