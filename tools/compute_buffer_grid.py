#!/usr/bin/env python3
"""Measure llama.cpp's compute buffers by no_alloc loads (edgemoe.perf.measure.compute_buffers) at every context x
ubatch x flash attention setting, beside the planner's estimate (edgemoe.plan.reserve.compute_buffer_bytes).

    .venv/bin/python tools/compute_buffer_grid.py MODEL --json docs/figures/compute-buffers-cpu-30b.json
    .venv/bin/python tools/compute_buffer_grid.py MODEL --rpc --json docs/figures/compute-buffers-rpc-30b.json

--rpc: every layer on llama.cpp's RPC device (served on loopback by this process), the experts in CPU memory, as a
plan with a budget loads the model; the device's buffer is compared. Without: the CPU alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.perf.measure.compute_buffers import measure_compute_buffers  # noqa: E402
from edgemoe.plan.reserve import compute_buffer_bytes  # noqa: E402
from edgemoe.runtime.config import LoadConfig  # noqa: E402

CONTEXTS = (4096, 16384, 32768)
UBATCHES = (512, 1024, 2048, 4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rpc", action="store_true", help="on the RPC device (every layer; the experts in CPU memory)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    info = read_model_info(args.model)
    layout: dict[str, object] = {}
    if args.rpc:
        from edgemoe.runtime import native

        native.rpc_loopback_device()
        layout = {"n_gpu_layers": 999, "cpu_expert_layers": tuple(info.moe_layers)}
    rows, t0 = [], time.time()
    for fa in ("on", "off"):
        for ctx in CONTEXTS:
            for ub in UBATCHES:
                cfg = LoadConfig(n_ctx=ctx, n_batch=ub, n_ubatch=ub, flash_attn=fa, **layout)  # type: ignore[arg-type]
                m = measure_compute_buffers(args.model, cfg)
                measured = m.device_bytes() if args.rpc else m.total
                est = compute_buffer_bytes(info, ctx, ub, flash_attn=fa == "on")
                rows.append(dict(fa=fa, ctx=ctx, ub=ub, measured=dict(m.by_buffer), estimate=est,
                                 err=est / measured - 1))
                print(f"fa {fa:3} ctx {ctx:6} ub {ub:5}: measured {measured / 2**20:8.1f} MiB, "
                      f"estimate {est / 2**20:8.1f} MiB ({100 * (est / measured - 1):+.1f}%)", flush=True)
    print(f"{len(rows)} measurements in {time.time() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
