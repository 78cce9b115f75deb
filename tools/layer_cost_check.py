#!/usr/bin/env python3
"""What one decoder layer of a model's shape costs in stock CPU decode, measured against the cost model's price.

Two shallow copies of a synthetic preset (tools/synth_gguf.py's; Qwen3-30B-A3B by default) with a 1,024-token
vocabulary, --shallow and --deep layers, are decoded through the Engine with no cache (a --prompt-tokens prompt,
--gen greedy tokens, the median of --reps runs; --rounds rounds with the fastest of each kept), with flash
attention off and on. The difference of the two depths is one layer's measured cost; beside it, the cost model's
price of one layer (dense products, the attention at the step's cached length, the top-k experts at one token
each, the layer's graph nodes at the node cost) from a profile (`edgemoe profile`'s file; default: this machine's). The whole-model check is
tools/check_cpu_projection.py; this one says which part of a layer an error comes from.

    .venv/bin/python tools/layer_cost_check.py --profile docs/figures/cpu-projection-check-zen5-cold-profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_perfmodel import measure  # noqa: E402

from edgemoe import Engine, LoadConfig  # noqa: E402
from edgemoe.gguf.presets import get_preset  # noqa: E402
from edgemoe.gguf.synth import write_synthetic  # noqa: E402
from edgemoe.perf.measure.profiling import default_profile_path  # noqa: E402
from edgemoe.perf.model.costmodel import LayerCosts, ModelShape  # noqa: E402
from edgemoe.perf.model.profile import load_profile  # noqa: E402

FLASH = ("off", "on")


def decode_ms(path: Path, flash: str, args: argparse.Namespace) -> tuple[float, int]:
    """Milliseconds per decode token at the median of args.reps greedy runs after a warm-up
    (tools/validate_perfmodel.py's measurement), and the decode graph's nodes."""
    n_ctx = (args.prompt_tokens + args.gen + 255) // 256 * 256
    with Engine(path, LoadConfig(n_ctx=n_ctx, n_threads=args.threads, flash_attn=flash)) as eng:
        prompt = [16 + i % 900 for i in range(args.prompt_tokens)]
        _, decode_tps, _ = measure(eng, prompt, args.gen, args.reps)
        nodes = (eng.graph_nodes or (0, 0))[1]
    return 1e3 / decode_tps, nodes


def priced_ms(path: Path, profile: Any, kv_len: int, nodes: dict[str, float]) -> dict[str, dict[str, float]]:
    """The cost model's milliseconds of one layer (its first MoE layer) by part, flash attention off and on;
    nodes: a layer's graph nodes with each, priced at the profile's node cost."""
    shape = ModelShape.read(path)
    il = shape.moe_layers[0]
    out = {}
    for flash in FLASH:
        costs = LayerCosts.of(profile.cpu, shape, flash_attn=flash == "on")
        parts = {
            "dense": costs.dense(il, 1),
            "attention": costs.attention(il, 1, kv_len),
            "experts": costs.experts(il, [1] * shape.n_expert_used),
            "nodes": nodes[flash] * profile.cpu.node_s,
        }
        out[flash] = {k: 1e3 * v for k, v in {**parts, "layer": sum(parts.values())}.items()}
    return out


def check(args: argparse.Namespace) -> dict[str, Any]:
    profile = load_profile(args.profile or default_profile_path())
    base = get_preset(args.preset)
    measured: dict[str, dict[int, float]] = {f: {} for f in FLASH}
    nodes: dict[str, dict[int, int]] = {f: {} for f in FLASH}
    with tempfile.TemporaryDirectory(prefix="edgemoe-layers-") as tmp:
        paths = {}
        for layers in (args.shallow, args.deep):
            preset = dataclasses.replace(base, name=f"{base.name}-l{layers}", n_layer=layers, n_vocab=1024)
            paths[layers] = write_synthetic(preset, Path(tmp) / f"l{layers}.gguf", progress=False)
        for _ in range(args.rounds):
            for layers, path in paths.items():
                for flash in FLASH:
                    ms, nodes[flash][layers] = decode_ms(path, flash, args)
                    measured[flash][layers] = min(measured[flash].get(layers, ms), ms)
                    print(f"{layers} layers, flash attention {flash}: {ms:.3f} ms a token", flush=True)
        span = args.deep - args.shallow
        per_layer = {f: (nodes[f][args.deep] - nodes[f][args.shallow]) / span for f in FLASH}
        priced = priced_ms(paths[args.deep], profile, args.prompt_tokens + args.gen // 2, per_layer)
    rows = {}
    for flash in FLASH:
        layer = (measured[flash][args.deep] - measured[flash][args.shallow]) / span
        rows[flash] = {
            "measured_layer_ms": layer,
            **{f"priced_{k}_ms": v for k, v in priced[flash].items()},
            "priced_over_measured": priced[flash]["layer"] / layer,
            "decode_ms": measured[flash],
        }
    return {"preset": args.preset, "profile": str(args.profile or default_profile_path()), "flash": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset", default="qwen3-30b-a3b", help="a synthetic preset (tools/synth_gguf.py --list)"
    )
    ap.add_argument("--profile", type=Path, default=None, help="a profile file (default: this machine's)")
    ap.add_argument("--shallow", type=int, default=2)
    ap.add_argument("--deep", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not 0 < args.shallow < args.deep:
        ap.error("give 0 < --shallow < --deep")
    out = check(args)
    for flash, row in out["flash"].items():
        print(
            f"flash attention {flash}: a layer measured {row['measured_layer_ms']:.3f} ms, priced "
            f"{row['priced_layer_ms']:.3f} ms (dense {row['priced_dense_ms']:.3f}, attention "
            f"{row['priced_attention_ms']:.3f}, experts {row['priced_experts_ms']:.3f}, graph nodes "
            f"{row['priced_nodes_ms']:.3f}): "
            f"{row['priced_over_measured']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
