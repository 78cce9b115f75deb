#!/usr/bin/env python3
"""Do the RPC stand-in's device and llama.cpp's CPU slow each other when both compute an expert at once?

One expert FFN of Qwen3-30B-A3B's shape (2048 x 768, Q4_K), 1 thread, timed on the CPU alone, on the RPC
device (loopback, 1 server thread) alone, then each while the other runs in a second Python thread (ggml
releases the GIL). Equal times mean the two sides of the stand-in do not contend for the machine.

    .venv/bin/python tools/contention_rpc.py
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe.perf.measure import microbench  # noqa: E402
from edgemoe.runtime import native  # noqa: E402

SHAPE = (2048, 768)


def ffn(device: int | None, tokens: int, seconds: float) -> float:
    t = microbench.time_expert_ffn("Q4_K", SHAPE[0], SHAPE[1], [tokens], threads=1, cold=False, device=device,
                                min_seconds=seconds)
    return t[tokens]


def main() -> int:
    dev = native.rpc_loopback_device(n_threads=1)
    for tokens in (16, 64):
        cpu, rpc = ffn(None, tokens, 1.0), ffn(dev, tokens, 1.0)
        both: dict[str, float] = {}
        bg = threading.Thread(target=lambda out, n: out.__setitem__("rpc", ffn(dev, n, 3.0)), args=(both, tokens))
        bg.start()
        time.sleep(0.3)
        both["cpu"] = ffn(None, tokens, 1.5)
        bg.join()
        print(f"{tokens} tokens: CPU {cpu * 1e3:.3f} ms alone, {both['cpu'] * 1e3:.3f} ms beside the device; "
              f"device {rpc * 1e3:.3f} ms alone, {both['rpc'] * 1e3:.3f} ms beside the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
