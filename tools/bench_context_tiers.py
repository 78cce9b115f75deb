#!/usr/bin/env python3
"""Context tiers (the fallback for lending the KV cache's unwritten cells) against the whole context from the start,
projected: decode hit rate, decode and prefill tok/s of the static cache at 1K, 4K, 16K and 32K tokens of
conversation, on the bundled Qwen3-30B-A3B routing profile, for an 8 GB laptop and a 16 GB card, f16 and q8_0 KV,
a 32K context.

With tiers, a conversation of L tokens runs at the smallest step that holds it, with the slots the plan gives that
step (edgemoe.plan.tiers.context_steps, the real counts); without, at the slots of the whole 32K context. Each
distinct slot count is replayed once through the simulator (edgemoe.perf.model.simulate; the trace's own prompts,
so attention over the conversation is the same on both sides and not in the figures). A step's pause is
projected as its KV state copied to the host and back at the link's pageable rate plus the new step's slots
refilled at the loader's rate (context creation not counted). Every figure is a projection.

    python tools/bench_context_tiers.py [--model M.gguf] [--json out.json]

Without --model it writes the full-depth synthetic Qwen3-30B-A3B's shape (tools/synth_gguf.py, tensors as holes)
to a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgemoe.analysis.routing_profile import routing_for_model  # noqa: E402
from edgemoe.gguf.info import ModelInfo, read_model_info  # noqa: E402
from edgemoe.gguf.kv_types import KvTypes  # noqa: E402
from edgemoe.perf.model.profile import MachineProfile, load_profile  # noqa: E402
from edgemoe.perf.model.simulate import SimSpec, simulate  # noqa: E402
from edgemoe.plan.budget import estimate_kv_cache_bytes  # noqa: E402
from edgemoe.plan.tiers import TierStep, context_steps  # noqa: E402

GiB = 1 << 30
CARDS = (("rtx4060-laptop", 8 * GiB), ("rtx5060ti-desktop", 16 * GiB))
KV = (KvTypes("f16", "f16"), KvTypes("q8_0", "q8_0"))
LENGTHS = (1024, 4096, 16384, 32768)
N_CTX = 32768


@dataclass(frozen=True)
class Point:
    slots: int
    decode_hit_rate: float
    decode_tps: float
    prefill_tps: float
    stock_decode_tps: float  # stock llama.cpp's best layout at the budget and the whole context, same replay
    stock_prefill_tps: float


def replay(model: Path, info: ModelInfo, prof: MachineProfile, vram: int, slots: int, kv: KvTypes,
           memo: dict[tuple[str, int, str], Point]) -> Point:
    key = (prof.name, slots, kv.k)
    if key not in memo:
        trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
        spec = SimSpec(vram=vram, n_ctx=N_CTX, policies=("static",), slots={il: slots for il in info.moe_layers},
                       overlap=True, kv=kv)
        configs = simulate(model, trace, prof, spec).configs
        ours = next(c for c in configs if c.kind == "edgemoe")
        stock = max((c for c in configs if c.kind != "edgemoe"), key=lambda c: c.decode_tps)
        memo[key] = Point(slots, ours.decode_hit_rate or 0.0, ours.decode_tps, ours.prefill_tps, stock.decode_tps,
                          stock.prefill_tps)
    return memo[key]


def pause_s(info: ModelInfo, prof: MachineProfile, prev: TierStep, step: TierStep, kv: KvTypes) -> float:
    """The projected pause of the step from `prev` (full) to `step`."""
    assert prof.link is not None
    kv_bytes = estimate_kv_cache_bytes(info, prev.n_ctx, kv)
    refill = step.slots_per_layer * info.slot_bytes
    return 2 * kv_bytes / prof.link.h2d_pageable + refill / prof.link.loads_bw


def rows(model: Path) -> list[dict[str, object]]:
    info = read_model_info(model)
    memo: dict[tuple[str, int, str], Point] = {}
    out: list[dict[str, object]] = []
    for name, vram in CARDS:
        prof = load_profile(name)
        for kv in KV:
            steps = context_steps(info, vram, N_CTX, kv)
            whole = steps[-1] if steps else None
            if whole is None:
                print(f"{name} {kv.k}: no step below {N_CTX} gains a slot", file=sys.stderr)
                continue
            off = replay(model, info, prof, vram, whole.slots_per_layer, kv, memo)
            pauses = {b.n_ctx: pause_s(info, prof, a, b, kv) for a, b in zip(steps, steps[1:], strict=False)}
            for n in LENGTHS:
                step = next(s for s in steps if s.n_ctx >= n)
                on = replay(model, info, prof, vram, step.slots_per_layer, kv, memo)
                out.append({"card": name, "vram": vram, "kv": kv.k, "tokens": n, "step": step.n_ctx,
                            "slots_off": off.slots, "slots_on": on.slots,
                            "hit_off": off.decode_hit_rate, "hit_on": on.decode_hit_rate,
                            "decode_off": off.decode_tps, "decode_on": on.decode_tps,
                            "prefill_off": off.prefill_tps, "prefill_on": on.prefill_tps,
                            "stock_decode": off.stock_decode_tps, "stock_prefill": off.stock_prefill_tps,
                            "steps": [s.n_ctx for s in steps], "step_pause_s": pauses})
                print(f"{name:18} {kv.k:5} {n:>6} step {step.n_ctx:>6}  slots {off.slots:>3} -> {on.slots:>3}  "
                      f"hit {off.decode_hit_rate:.3f} -> {on.decode_hit_rate:.3f}  decode {off.decode_tps:6.1f} -> "
                      f"{on.decode_tps:6.1f} ({on.decode_tps / off.decode_tps:.2f}x)  prefill {off.prefill_tps:6.0f}"
                      f" -> {on.prefill_tps:6.0f}  stock best {off.stock_decode_tps:5.1f}/{off.stock_prefill_tps:4.0f}",
                      flush=True)
            print(f"{name:18} {kv.k:5} step pauses (s): "
                  + ", ".join(f"to {c}: {p:.2f}" for c, p in pauses.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a GGUF (its header is read); default: the synthetic 30B's shape")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from edgemoe.gguf.synth import write_synthetic

            model = write_synthetic("qwen3-30b-a3b", Path(tmp) / "qwen3-30b-a3b.gguf", shape_only=True,
                                    progress=False)
        out = rows(model)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
