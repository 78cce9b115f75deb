#!/usr/bin/env python3
"""Copy a GGUF with one expert's down-projection output channel scaled up: the signature of a "super expert"
(Su et al. 2025), for tests/test_super_experts.py and the figures of docs/gating.md ("Super experts").

  .venv/bin/python tools/plant_super_expert.py SRC DST [--layer 0] [--expert 5] [--channel 7] [--scale 200]

The layer's ffn_down_exps must be Q8_0 (as layer 0 of the qwen3moe fixture is): every 32-weight block of the
channel's row has its f16 scale multiplied, so that channel of the expert's output grows by --scale exactly.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import gguf
import numpy as np


def plant_super_expert(src: Path, dst: Path, *, layer: int = 0, expert: int = 5, channel: int = 7,
                       scale: float = 200.0) -> None:
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == f"blk.{layer}.ffn_down_exps.weight")
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        raise SystemExit(f"blk.{layer}.ffn_down_exps is {t.tensor_type.name}, not Q8_0: pick another --layer")
    n_ff, n_embd, _ = (int(x) for x in t.shape)
    row = n_ff // 32 * 34  # Q8_0: 34-byte blocks of 32 weights, an f16 scale first
    shutil.copyfile(src, dst)
    with dst.open("r+b") as f:
        for b in range(n_ff // 32):
            at = t.data_offset + (expert * n_embd + channel) * row + b * 34
            f.seek(at)
            d = np.frombuffer(f.read(2), np.float16)[0]
            f.seek(at)
            f.write(np.float16(float(d) * scale).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--expert", type=int, default=5)
    ap.add_argument("--channel", type=int, default=7)
    ap.add_argument("--scale", type=float, default=200.0)
    a = ap.parse_args()
    plant_super_expert(a.src, a.dst, layer=a.layer, expert=a.expert, channel=a.channel, scale=a.scale)


if __name__ == "__main__":
    main()
