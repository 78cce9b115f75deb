#!/usr/bin/env python3
"""Validate the performance model's device parts on the RPC stand-in: measured vs projected, one process.

llama.cpp's RPC backend serves the CPU backend over loopback TCP from a server thread in this process;
edgemoe sees it as a GPU (a device of its own, with a copy path and a compute stream of its own). On a
2-core machine with 1 CPU thread for llama.cpp and 1 server thread, the "device" and the "host" each get
a core, so CPU and device work can overlap and expert loads cross a link (TCP) with a bandwidth of its own.

1. `edgemoe profile`'s measurement (measure_profile) with the RPC device as the GPU: CPU curves, device
   curves, host-to-device bandwidth, written to --profile-out;
2. `edgemoe bench` (run_bench) at --vram on the device: stock -ot exps=CPU, stock's best --n-cpu-moe,
   edgemoe lru and static (equal slots), each with the projection from that profile beside it.

It prints bench's table (measured, projected, error) and, with --json, writes the rows and the profile.

    .venv/bin/python tools/validate_rpc.py models/edgemoe-tiny-qwen3moe.Q4_K_M.gguf --vram 40MiB \
        --json docs/figures/perfmodel-rpc-qwen3moe.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.gguf.info import parse_size  # noqa: E402
from edgemoe.perf.bench.report import format_table  # noqa: E402
from edgemoe.perf.bench.rows import BenchSpec  # noqa: E402
from edgemoe.perf.bench.run import run_bench  # noqa: E402
from edgemoe.perf.measure.profiling import measure_profile  # noqa: E402
from edgemoe.placement import calibration_for  # noqa: E402
from edgemoe.runtime import native  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--vram", required=True, help="device budget, e.g. 40MiB")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--profile-out", type=Path, default=Path("/tmp/edgemoe-rpc-profile.json"))
    ap.add_argument("--reuse-profile", action="store_true", help="use --profile-out as it is (no measuring)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    vram = parse_size(args.vram, option="--vram")

    dev = native.rpc_loopback_device(n_threads=1)
    print(f"device: {native.device_name(dev)} (RPC loopback, 1 server thread); llama.cpp CPU threads: 1",
          file=sys.stderr)
    t0 = time.perf_counter()
    if not args.reuse_profile:
        prof = measure_profile(threads=1, model=args.model,
                               progress=lambda f: print(f"\rprofile {f:4.0%}", end="", file=sys.stderr))
        prof.save(args.profile_out)
        print(f"\nprofile written to {args.profile_out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    spec = BenchSpec(vram=vram, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen, threads=1,
                     policies=("lru", "static"),
                     calibration=calibration_for(args.model, ("lru", "static"), "equal", None, n_threads=1),
                     alloc="equal", profile=args.profile_out)
    res = run_bench(args.model, spec, progress=lambda name: print(f"running {name} ...", file=sys.stderr))
    print(format_table(res))
    if args.json is not None:
        out = {"model": str(args.model), "vram": vram, "bench": res.to_dict(),
               "profile": json.loads(args.profile_out.read_text())}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
