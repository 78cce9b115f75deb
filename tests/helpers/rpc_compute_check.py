"""Run by tests/test_compute_buffers.py in a process of its own: the compute buffers a no_alloc load measures on
llama.cpp's RPC device (serving the CPU backend on loopback), every layer on it and the experts in CPU memory, as a
plan with a budget loads the model; and open_engine's plan, which measures them."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

# isort: split
from edgemoe.gguf.info import read_model_info
from edgemoe.perf.measure.compute_buffers import measure_grid
from edgemoe.plan.reserve import budget_for_slots
from edgemoe.runtime import native
from edgemoe.runtime.config import LoadConfig

from helpers.child_result import write_and_exit


def main(path: Path) -> dict[str, object]:
    native.rpc_loopback_device()
    moe = tuple(read_model_info(path).moe_layers)
    out: dict[str, object] = {"rows": []}
    for fa in ("on", "off"):
        cfg = LoadConfig(n_gpu_layers=999, cpu_expert_layers=moe, flash_attn=fa)  # type: ignore[arg-type]
        for m in measure_grid(path, cfg, (4096, 16384), (512, 2048)):
            out["rows"].append({"fa": fa, "n_ctx": m.n_ctx, "n_ubatch": m.n_ubatch, "device": m.device_bytes(),
                                "buffers": dict(m.by_buffer)})  # type: ignore[union-attr]
    from edgemoe.placement import cache_request, open_engine, this_device

    out["device"] = this_device() is not None
    notes: list[str] = []
    vram = budget_for_slots(read_model_info(path), 4, 256)
    cache = cache_request(vram=vram, policy="lru", alloc="equal")
    with open_engine(path, cache=cache, n_ctx=256, n_threads=2, notify=notes.append) as eng:
        out["slots"] = dict(eng.experts.n_slots) if eng.experts is not None else None
    return out


if __name__ == "__main__":
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])), default=str)
