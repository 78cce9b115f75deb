#!/usr/bin/env python3
"""Check the performance model's CPU decode projection on this machine, end to end.

1. Make (or reuse) the full-depth synthetic Qwen3-30B-A3B, Q4_K (tools/synth_gguf.py's preset; 16 GiB).
2. Measure this machine's profile (`edgemoe profile`) into --profile-out, timed, collecting its warnings
   (--reuse-profile: read the file instead).
3. Measure stock CPU decode of the model through edgemoe's Engine with no expert cache: greedy generation
   from a --prompt-tokens prompt of the Shakespeare corpus's held-out part, --gen tokens, median of --reps
   runs after a warm-up (tools/validate_perfmodel.py's measurement), decode tok/s counting the tokens after
   the first.
4. Record (or reuse) the routing of the same tokens as a decode trace (`edgemoe trace --mode decode`).
5. Project the simulation's stock CPU row (`edgemoe simulate --vram 0`, row stock-cpu) from the profile and
   the trace, and print measured, projected and their ratio. Exit status 1 when the projection is off by more
   than --max-error or the profile warned.

The timings need an idle machine (the profile says how much of the CPUs other processes took); --wait-idle
waits up to that many minutes for the 1-minute load average to drop below --idle-load first.

    .venv/bin/python tools/check_cpu_projection.py --wait-idle 20 --json docs/figures/cpu-projection-check.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_perfmodel import measure, prompt_tokens  # noqa: E402

from edgemoe import Engine, LoadConfig  # noqa: E402
from edgemoe.analysis.trace import Trace, record_trace  # noqa: E402
from edgemoe.gguf.synth import write_synthetic  # noqa: E402
from edgemoe.perf.measure.profiling import measure_profile, summary  # noqa: E402
from edgemoe.perf.model.profile import MachineProfile, load_profile  # noqa: E402
from edgemoe.perf.model.simulate import SimSpec, simulate  # noqa: E402

PRESET = "qwen3-30b-a3b"
DEFAULT_DIR = Path("/work/models")


class _Collect(logging.Handler):
    """Keeps the warnings edgemoe logs while the profile is measured."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_idle(minutes: float, below: float) -> float:
    """Sleep in 30 s steps until the 1-minute load average is below `below` or `minutes` have passed."""
    end = time.monotonic() + 60 * minutes
    while load1() >= below and time.monotonic() < end:
        print(f"load {load1():.2f}: waiting for an idle machine", flush=True)
        time.sleep(30)
    return load1()


def ensure_model(path: Path) -> Path:
    if not path.exists():
        print(f"writing {path} (the full-depth synthetic {PRESET}, Q4_K)", flush=True)
        write_synthetic(PRESET, path, qtype="Q4_K", progress=True)
    return path


def ensure_profile(path: Path, *, reuse: bool, threads: int) -> tuple[MachineProfile, list[str], float | None]:
    """The profile, the warnings its measurement logged, and its wall time (None when reused)."""
    if reuse and path.exists():
        return load_profile(path), [], None
    handler = _Collect()
    logging.getLogger("edgemoe").addHandler(handler)
    t0 = time.perf_counter()
    try:
        prof = measure_profile(threads=threads)
    finally:
        logging.getLogger("edgemoe").removeHandler(handler)
    wall = time.perf_counter() - t0
    prof.save(path)
    return prof, handler.messages, wall


def measure_and_trace(model: Path, trace_path: Path, args: argparse.Namespace) -> tuple[float, float, Trace]:
    """Stock CPU (prefill, decode) tok/s, medians of args.reps runs, and the decode trace of the same tokens."""
    n_ctx = (args.prompt_tokens + args.gen + 255) // 256 * 256
    with Engine(model, LoadConfig(n_ctx=n_ctx, n_threads=args.threads, flash_attn=args.flash_attn)) as eng:
        prompt = prompt_tokens(eng, args.prompt_tokens, heldout=True)
        prefill_tps, decode_tps, out = measure(eng, prompt, args.gen, args.reps)
        if trace_path.exists():
            trace = Trace.load(trace_path)
        else:
            trace = record_trace(eng, prompt + out[:-1], ctx=n_ctx, mode="decode", prefill_tokens=len(prompt))
            trace.save(trace_path)
    return prefill_tps, decode_tps, trace


def check(args: argparse.Namespace) -> dict[str, Any]:
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.model or work / f"{PRESET}.Q4_K.gguf")
    load_before = wait_idle(args.wait_idle, args.idle_load) if args.wait_idle else load1()
    profile_path = args.profile_out or work / "check-cpu-profile.json"
    prof, warnings, wall = ensure_profile(profile_path, reuse=args.reuse_profile, threads=args.threads)
    print(summary(prof), flush=True)
    trace_path = work / f"check-cpu-trace-p{args.prompt_tokens}-g{args.gen}.npz"
    prefill_tps, decode_tps, trace = measure_and_trace(model, trace_path, args)
    n_ctx = (args.prompt_tokens + args.gen + 255) // 256 * 256
    spec = SimSpec(vram=0, n_ctx=n_ctx, n_ubatch=512, policies=(), flash_attn=args.flash_attn)
    sim = simulate(model, trace, prof, spec)
    row = next(c for c in sim.configs if c.name == "stock-cpu")
    return {
        "model": str(model),
        "profile": str(profile_path),
        "profile_wall_s": wall,
        "profile_warnings": warnings,
        "profile_notes": prof.notes,
        "flash_attn": args.flash_attn,
        "workload_note": sim.workload_note,
        "trace": str(trace_path),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen,
        "reps": args.reps,
        "load1_before": load_before,
        "load1_after": load1(),
        "cpus": os.cpu_count(),
        "measured_decode_tps": decode_tps,
        "projected_decode_tps": row.decode_tps,
        "decode_ratio": row.decode_tps / decode_tps,
        "measured_prefill_tps": prefill_tps,
        "projected_prefill_tps": row.prefill_tps,
        "prefill_ratio": row.prefill_tps / prefill_tps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help=f"the GGUF (default: WORK_DIR/{PRESET}.Q4_K.gguf)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_DIR, help="model, profile and trace go here")
    ap.add_argument("--profile-out", type=Path, default=None, help="default: WORK_DIR/check-cpu-profile.json")
    ap.add_argument("--reuse-profile", action="store_true", help="read --profile-out instead of measuring")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                    help="the measured engine's and the projection's (stock llama.cpp's default: auto, on for "
                    "the CPU)")
    ap.add_argument("--max-error", type=float, default=0.15, help="the bar for |projected / measured - 1|")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="MINUTES")
    ap.add_argument("--idle-load", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = check(args)
    wall = "reused" if res["profile_wall_s"] is None else f"{res['profile_wall_s']:.0f} s"
    print(f"profile: {res['profile']} ({wall}); warnings: {len(res['profile_warnings'])}")
    for w in res["profile_warnings"]:
        print(f"  warning: {w}")
    print(f"load average (1 min) before {res['load1_before']:.2f}, after {res['load1_after']:.2f}")
    print(f"stock CPU decode: measured {res['measured_decode_tps']:.2f} tok/s, projected "
          f"{res['projected_decode_tps']:.2f} tok/s, ratio {res['decode_ratio']:.3f}")
    print(f"stock CPU prefill: measured {res['measured_prefill_tps']:.1f} tok/s, projected "
          f"{res['projected_prefill_tps']:.1f} tok/s, ratio {res['prefill_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if abs(res["decode_ratio"] - 1) > args.max_error or res["profile_warnings"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
