#!/usr/bin/env python3
"""DALI's greedy CPU/GPU assignment against the exact optimum on recorded prefill routes.

  PYTHONPATH=. .venv/bin/python tools/assignment_eval.py --record DIR [--max-tokens 65536]
  PYTHONPATH=. .venv/bin/python tools/assignment_eval.py TRACE.npz ... [--expert qwen3-30b-a3b] [--json OUT]

--record writes the held-out split (last 10%) of each corpus in ../shared/corpus to DIR and
records a prefill trace of each fixture on it (as `edgemoe trace MODEL --input FILE --mode
prefill --ctx 512`), skipping traces already there, then evaluates DIR/*.npz.

Each trace's prefill tokens are cut, per sequence, into ubatches of the trace's n_batch (512:
one ubatch per 512-token chunk, as llama.cpp ran them); each MoE layer of each ubatch is one
instance: workload = tokens routed to each expert. Every instance is solved by greedy_assign
and by exact_assign (meet-in-the-middle, exact for all 32 experts of the qwen3moe fixture;
brute force agrees where n <= 12) under an ASSUMED laptop cost model (constants below), for
both transfer modes and three GPU cache sizes. The resident experts of a layer are the busiest
of that layer in the previous ubatch of the trace (a workload-aware cache with a one-ubatch
window, as DALI's); the first ubatch of a trace starts with an empty cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemoe.analysis.trace import PREFILL, Trace
from edgemoe.policies.assignment import (
    CostModel,
    MissAction,
    TransferMode,
    decode_miss_costs,
    exact_assign,
    greedy_assign,
    optimal_assign,
    ratio_assign,
)

ROOT = Path(__file__).resolve().parent.parent

MODELS = [ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf", ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"]
CORPORA = ["tinyshakespeare.txt", "python-docs.txt"]

# --- the assumed laptop (not measured: edgemoe/perf/model/costmodel.py will supply measured profiles) ---
CPU_BW = 60e9  # B/s, host memory read by the CPU's matmuls (dual-channel DDR5 laptop, effective)
CPU_FLOPS = 0.6e12  # FLOP/s, Q4_K matmul on the laptop's P-cores (AVX2/AVX-512 dot products)
GPU_BW = 200e9  # B/s, VRAM (RTX 4060/4070 laptop class: 256-272 GB/s peak)
GPU_FLOPS = 12e12  # FLOP/s, quantized matmul throughput reached on such a GPU
PCIE_BW = 12e9  # B/s, host -> GPU copies from pinned memory (PCIe 4.0 x8 / 3.0 x16 effective)
CPU_EXPERT_FIXED_S = 5e-6  # thread-pool barriers of an expert's three matmuls
GPU_EXPERT_FIXED_S = 10e-6  # three kernel launches
SYNC_S = 20e-6  # CPU/GPU event sync when any expert runs on the CPU
SPLIT_OVERHEAD_S = 10e-6  # a decode split: the second launch and the add of the two partial sums
ACT_BYTES = 4  # f32 activations: the ubatch's hidden states go to the host and the CPU's sum back
Q4_K_BYTES_PER_WEIGHT = 144 / 256  # a Q4_K block: 256 weights in 144 bytes (4.5 bits)


@dataclass(frozen=True)
class ExpertShape:
    n_embd: int
    n_ff: int  # the expert's intermediate size; gate, up and down: 3 matrices of n_embd x n_ff

    @property
    def bytes(self) -> float:
        return 3 * self.n_embd * self.n_ff * Q4_K_BYTES_PER_WEIGHT

    @property
    def flops_per_token(self) -> float:
        return 2 * 3 * self.n_embd * self.n_ff


EXPERTS = {
    "qwen3-30b-a3b": ExpertShape(2048, 768),  # ~2.65 MB in Q4_K: the expert the brief sizes by
    "mixtral-8x7b": ExpertShape(4096, 14336),  # ~99 MB in Q4_K: few, large experts
}
RESIDENT_FRACTIONS = (0.0, 0.25, 0.5)


def laptop_cost(expert: ExpertShape, ubatch_tokens: int, mode: TransferMode) -> CostModel:
    """Roofline per expert: max(weights / bandwidth, tokens * FLOPs / peak) plus a fixed cost."""
    b, f = expert.bytes, expert.flops_per_token
    handoff = SYNC_S + 2 * ubatch_tokens * expert.n_embd * ACT_BYTES / PCIE_BW
    return CostModel(cpu_s=lambda n: CPU_EXPERT_FIXED_S + max(b / CPU_BW, n * f / CPU_FLOPS),
                     gpu_s=lambda n: GPU_EXPERT_FIXED_S + max(b / GPU_BW, n * f / GPU_FLOPS),
                     transfer_s=lambda: b / PCIE_BW, cpu_handoff_s=handoff, transfer_mode=mode,
                     split_overhead_s=SPLIT_OVERHEAD_S)


def ubatches(trace: Trace, size: int) -> Iterator[np.ndarray]:
    """The prefill ids of each ubatch, (n_tokens, L, k): each sequence cut into pieces of `size`."""
    pre = trace.phase == PREFILL
    for s in np.unique(trace.seq[pre]):
        ids = trace.ids[pre & (trace.seq == s)]
        for start in range(0, ids.shape[0], size):
            yield ids[start:start + size]


METHODS = {"greedy": greedy_assign, "ratio": ratio_assign}  # the cheap ones, scored against exact_assign


@dataclass
class Tally:
    ratio: dict[str, list[float]]  # method -> makespan / optimum per instance
    seconds: dict[str, list[float]]  # method -> its runtime per instance (costs evaluated included)
    resident_only: list[float]  # resident experts on the GPU, the rest on the CPU (no loads), / optimum
    all_gpu: list[float]  # everything on the GPU, / optimum
    active: list[int]  # experts with a non-zero workload
    exact_s: list[float]
    optimum_s: list[float]  # the optimal makespan

    @classmethod
    def empty(cls) -> Tally:
        return cls({m: [] for m in METHODS}, {m: [] for m in METHODS}, [], [], [], [], [])

    def extend(self, other: Tally) -> None:
        for m in METHODS:
            self.ratio[m] += other.ratio[m]
            self.seconds[m] += other.seconds[m]
        self.resident_only += other.resident_only
        self.all_gpu += other.all_gpu
        self.active += other.active
        self.exact_s += other.exact_s
        self.optimum_s += other.optimum_s


def evaluate(trace: Trace, expert: ExpertShape, mode: TransferMode, fraction: float, size: int) -> Tally:
    n_expert = trace.n_expert
    n_res = round(fraction * n_expert)
    t = Tally.empty()
    prev: np.ndarray | None = None  # (L, n_expert) workloads of the previous ubatch
    for ids in ubatches(trace, size):
        cost = laptop_cost(expert, ids.shape[0], mode)
        counts = np.stack([np.bincount(ids[:, li].reshape(-1), minlength=n_expert) for li in range(ids.shape[1])])
        for li in range(ids.shape[1]):
            work = {int(e): int(w) for e, w in enumerate(counts[li]) if w > 0}
            resident = set() if prev is None or n_res == 0 else \
                {int(e) for e in np.argsort(-prev[li], kind="stable")[:n_res]}
            t0 = time.perf_counter()
            best = exact_assign(work, resident, cost).makespan
            t.exact_s.append(time.perf_counter() - t0)
            t.optimum_s.append(best)
            if len(work) <= 12:  # the brute force agrees (and checks the meet-in-the-middle)
                o = optimal_assign(work, resident, cost)
                assert abs(o.makespan - best) <= 1e-12 * best, (o, best)
            for name, solve in METHODS.items():
                t0 = time.perf_counter()
                a = solve(work, resident, cost)
                t.seconds[name].append(time.perf_counter() - t0)
                t.ratio[name].append(a.makespan / best)
            t.resident_only.append(_makespan(work, set(work) & resident, cost) / best)
            t.all_gpu.append(_makespan(work, set(work), cost, resident) / best)
            t.active.append(len(work))
        prev = counts
    return t


def _makespan(work: dict[int, int], on_gpu: set[int], cost: CostModel, resident: set[int] | None = None) -> float:
    """A fixed placement's makespan (resident: experts on the GPU that need no copy; default on_gpu)."""
    resident = on_gpu if resident is None else resident
    x = cost.transfer_s()
    t_gpu = 0.0
    for e in on_gpu:
        gs = cost.gpu_s(work[e])
        t_gpu += gs if e in resident else (max(x, gs) if cost.transfer_mode is TransferMode.PIPELINED else x + gs)
    cpu = [cost.cpu_s(w) for e, w in work.items() if e not in on_gpu]
    return max(cost.cpu_handoff_s + sum(cpu) if cpu else 0.0, t_gpu)


def print_decode_misses(expert: ExpertShape, name: str) -> None:
    """decode_miss_choice under the same cost model, for a miss routed 1..64 tokens (batched decode)."""
    print(f"\ndecode miss, expert {name}: time of each action in us (chosen action in bold)\n")
    print("| tokens | cpu | wait | split | choice |")
    print("|" + " --- |" * 5)
    for n in (1, 2, 4, 8, 16, 64):
        costs = decode_miss_costs(n, laptop_cost(expert, n, TransferMode.PIPELINED))
        best = min(costs, key=lambda a: costs[a])
        cells = [f"**{costs[a] * 1e6:.0f}**" if a is best else f"{costs[a] * 1e6:.0f}" for a in MissAction]
        print(f"| {n} | {' | '.join(cells)} | {best.value} |")


def record(out_dir: Path, max_tokens: int) -> None:
    from edgemoe.analysis.trace import record_trace
    from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
    from edgemoe.runtime.engine import Engine, LoadConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for c in CORPORA:
        text_path = out_dir / f"{Path(c).stem}.heldout.txt"
        if not text_path.exists():
            text_path.write_text(split_corpus(default_corpus_dir() / c).heldout_text(), encoding="utf-8")
        for model in MODELS:
            out = out_dir / f"{model.name.split('.')[0].removeprefix('edgemoe-tiny-')}-{Path(c).stem}.npz"
            if out.exists():
                continue
            with Engine(model, LoadConfig(n_ctx=512, n_threads=2)) as eng:
                tokens = eng.tokenize(text_path.read_text(encoding="utf-8"))[:max_tokens]
                tr = record_trace(eng, tokens, ctx=512, mode="prefill")
            tr.meta["input"] = str(text_path)
            tr.save(out)
            print(f"recorded {out}: {tr.n_tokens} tokens", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", type=Path, nargs="*", help="prefill traces (.npz) to evaluate")
    ap.add_argument("--record", type=Path, default=None, metavar="DIR",
                    help="record the fixtures' held-out prefill traces into DIR (missing ones), evaluate DIR/*.npz")
    ap.add_argument("--max-tokens", type=int, default=65536, help="with --record: tokens per trace")
    ap.add_argument("--expert", choices=sorted(EXPERTS), default="qwen3-30b-a3b",
                    help="the expert size the cost model assumes")
    ap.add_argument("--ubatch", type=int, default=0, help="tokens per ubatch (0: the trace's n_batch)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    if args.record is not None:
        record(args.record, args.max_tokens)
        args.traces += sorted(args.record.glob("*.npz"))
    if not args.traces:
        ap.error("give traces, or --record DIR")

    by_model: dict[str, list[Trace]] = {}
    for p in args.traces:
        tr = Trace.load(p)
        by_model.setdefault(Path(str(tr.meta.get("model", p))).name.split(".")[0], []).append(tr)
    expert = EXPERTS[args.expert]
    print(f"expert {args.expert}: {expert.bytes / 1e6:.2f} MB, copy {expert.bytes / PCIE_BW * 1e6:.0f} us")
    header = ("| model | transfer | cache | ubatch-layers | active experts | DALI greedy / opt: mean, worst, optimal "
              "| ratio cut / opt: mean, worst, optimal | resident-only / opt | all-GPU / opt "
              "| optimum ms/layer | us per layer: greedy, ratio (p99) | exact ms/layer |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    rows = []
    for model, traces in sorted(by_model.items()):
        for mode in TransferMode:
            for frac in RESIDENT_FRACTIONS:
                t = Tally.empty()
                for tr in traces:
                    t.extend(evaluate(tr, expert, mode, frac, args.ubatch or int(tr.meta.get("n_batch", 512))))
                row: dict[str, object] = {
                    "model": model, "expert": args.expert, "transfer": mode.value, "resident_fraction": frac,
                    "instances": len(t.active), "active_mean": statistics.fmean(t.active),
                    "resident_only_mean": statistics.fmean(t.resident_only),
                    "all_gpu_mean": statistics.fmean(t.all_gpu), "exact_ms_mean": statistics.fmean(t.exact_s) * 1e3,
                    "optimum_ms_mean": statistics.fmean(t.optimum_s) * 1e3}
                for m in METHODS:
                    us = sorted(x * 1e6 for x in t.seconds[m])
                    row[m] = {"mean": statistics.fmean(t.ratio[m]), "worst": max(t.ratio[m]),
                              "optimal_share": sum(r <= 1 + 1e-9 for r in t.ratio[m]) / len(t.ratio[m]),
                              "us_median": us[len(us) // 2], "us_p99": us[int(0.99 * (len(us) - 1))]}
                rows.append(row)
                g, r = row["greedy"], row["ratio"]
                assert isinstance(g, dict) and isinstance(r, dict)
                print(f"| {model.removeprefix('edgemoe-tiny-')} | {mode.value} | {frac:.0%} | {row['instances']} "
                      f"| {row['active_mean']:.1f} "
                      f"| {g['mean']:.4f}, {g['worst']:.3f}, {g['optimal_share']:.1%} "
                      f"| {r['mean']:.4f}, {r['worst']:.3f}, {r['optimal_share']:.1%} "
                      f"| {row['resident_only_mean']:.2f} | {row['all_gpu_mean']:.2f} | {row['optimum_ms_mean']:.2f} "
                      f"| {g['us_median']:.0f}, {r['us_median']:.0f} ({g['us_p99']:.0f}, {r['us_p99']:.0f}) "
                      f"| {row['exact_ms_mean']:.1f} |", flush=True)
    print_decode_misses(expert, args.expert)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
