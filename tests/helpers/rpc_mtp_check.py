"""Run by tests/test_mtp_speculation.py in a process of its own: MTP drafting with the expert cache on llama.cpp's
RPC backend (a registered RPC device is seen by every model loaded afterwards in the process).

The CLI's GPU layout: every layer and the KV cache on the device, the trunk's routed experts in CPU memory with
the cache's slots on the device, the MTP block's experts in CPU memory too (edgemoe.runtime.handle.buft_overrides);
the MTP context runs on the same weights without a cache. Greedy output with MTP drafting must equal greedy
without it on the same engine, and every id row handed to the device must be valid. Writes one JSON object to the
file named by argv[2].
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

import helpers.rpc_kernels  # noqa: F401  # first: the CPU kernels' setting for bitwise runs on the RPC device

# isort: split

from edgemoe.gguf.info import read_model_info
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY
from edgemoe.speculation import SpeculationConfig

from helpers.child_result import write_and_exit

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 2


def main(path: Path) -> dict[str, object]:
    dev = native.rpc_loopback_device()
    info = read_model_info(path)
    cfg = LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, use_extra_bufts=False, op_offload=False,
                     n_gpu_layers=999, cpu_expert_layers=tuple(info.moe_layers), load_mtp=True)
    with Engine(path, cfg) as eng:
        eng.enable_expert_cache(CacheConfig(info.n_expert // 4, policy=LruConfig()), device=dev)
        eng.set_ids_check(True)
        plain = eng.generate(TEXT, max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        eng.reset()
        g = eng.generate(TEXT, max_tokens=24, sampling=GREEDY, ignore_eog=True)
        assert g.speculation is not None and eng.experts is not None
        return {"device": native.device_name(dev), "equal": g.tokens == plain, "stats": g.speculation.to_dict(),
                "cache": eng.experts.stats(), "ids_check": eng.ids_check()}


if __name__ == "__main__":
    # to a file: the RPC server thread prints connection messages to stdout at any time
    write_and_exit(sys.argv[2], main(Path(sys.argv[1])))
