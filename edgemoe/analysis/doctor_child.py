"""One step of `edgemoe doctor`, run as ``python -m edgemoe.analysis.doctor_child '<json step>'``.

Each step runs in a process of its own, so a native crash (a segfault in llama_model_load_from_file, an
abort in a CUDA call) ends this process, not doctor. Before each phase the child prints ``PHASE <name>`` and
flushes, so that the parent knows where a crash happened; its result is written as JSON to the file named
after the step (and printed as ``RESULT <json>``): llama.cpp's own threads write to the same stdout (the RPC
server's connection lines), so the file is what the parent reads.

Steps: ``build`` (patch level, ggml, backends and their features, CUDA versions), ``devices`` (every ggml
device with its memory and, for NVIDIA GPUs, the PCIe link from NVML), ``generate`` (an Engine on the
fixture with n_gpu_layers layers offloaded, ``rpc``: on llama.cpp's RPC device on loopback, 4 greedy tokens),
``cli`` (``edgemoe generate --json`` with the given arguments, run as ``python -m edgemoe.cli`` runs it, after
registering the RPC device on loopback when ``rpc``: the CLI's own process, where the cache device is the first
GPU ggml sees).

``EDGEMOE_DOCTOR_FAULT=<step>:<phase>`` makes that phase crash with SIGSEGV, ``<step>:<phase>:hang`` makes it
hang: what doctor's tests use to show that a crash or a hang is reported as the step's failure.
``cli:prefill`` crashes with SIGSEGV in the CLI's first multi-token ubatch with an expert cache (what CUDA's
MMQ path did with repeated ids), ``cli:prefill:wrong`` lowers that ubatch's top logit instead (wrong tokens).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import runpy
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the child imports the native library only inside its steps
    from ..runtime.native.loader import CxxRuntimeGuard

N_TOKENS = 4
PROMPT = "The capital of France is"


def _crash() -> None:
    ctypes.string_at(0)  # a NULL read: SIGSEGV, as a native crash would


def _phase(step: str, name: str) -> None:
    print(f"PHASE {name}", flush=True)
    fault = os.environ.get("EDGEMOE_DOCTOR_FAULT", "")
    if fault == f"{step}:{name}":
        _crash()
    if fault == f"{step}:{name}:hang":
        time.sleep(3600)  # as a native deadlock would


def build_info() -> dict[str, Any]:
    _phase("build", "import")
    import llama_cpp

    from ..runtime import native

    _phase("build", "query")
    version, commit = native.ggml_version()
    backends = dict(native.backend_registries())
    cuda = native.cuda_versions()
    archs = backends.get("CUDA", {}).get("ARCHS")
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "ggml_version": version,
        "ggml_commit": commit,
        "patch_level": native.patch_level(),
        "required_patch_level": native.REQUIRED_PATCH_LEVEL,
        "library": getattr(native.lib._lib, "_name", "?"),
        "gpu_offload": native.supports_gpu_offload(),
        "kind": "CUDA" if "CUDA" in backends else "CPU",
        "cuda_archs": archs,
        "backends": backends,
        "cuda_driver": cuda[0] if cuda else None,
        "cuda_runtime": cuda[1] if cuda else None,
        "cxx_runtime": _cxx_runtime(native.cxx_runtime_guard),
    }


def _cxx_runtime(guard: CxxRuntimeGuard) -> dict[str, Any]:
    """What the loader's guard found: libraries beside libllama carrying their own C++ runtime, and what it did."""
    return {"offenders": list(guard.offenders), "preloaded": guard.preloaded, "too_late": guard.too_late}


def device_info() -> dict[str, Any]:
    _phase("devices", "import")
    from ..runtime import native

    _phase("devices", "query")
    kinds = {0: "CPU", 1: "GPU", 2: "ACCEL", 3: "IGPU"}
    out = []
    for _, props in native.devices():
        dev: dict[str, Any] = {
            "name": (props.name or b"").decode(),
            "description": (props.description or b"").decode(),
            "type": kinds.get(props.type, str(props.type)),
            "memory_free": int(props.memory_free),
            "memory_total": int(props.memory_total),
            "pci_bus_id": props.device_id.decode() if props.device_id else None,
        }
        if dev["pci_bus_id"] and dev["name"].startswith("CUDA"):
            dev["nvml"] = native.nvml_pcie(dev["pci_bus_id"])
        out.append(dev)
    return {"devices": out}


def generate(model: str, n_gpu_layers: int, rpc: bool) -> dict[str, Any]:
    _phase("generate", "import")
    from ..runtime import native
    from ..runtime.engine import Engine, LoadConfig
    from ..runtime.sampling import GREEDY

    device = "CPU"
    if rpc:
        _phase("generate", "rpc")
        device = native.device_name(native.rpc_loopback_device())
    elif n_gpu_layers > 0:
        gpu = native.gpu_device()
        device = native.device_name(gpu) if gpu else "CPU"
    _phase("generate", "load")
    with Engine(model, LoadConfig(n_ctx=256, n_threads=2, n_gpu_layers=n_gpu_layers)) as eng:
        _phase("generate", "decode")
        tokens = list(eng.generate(PROMPT, max_tokens=N_TOKENS, sampling=GREEDY).tokens)
    return {"device": device, "tokens": tokens}


def device_ids_info(rpc: bool) -> dict[str, Any]:
    """Each device's id-row mode, its self-test run again (and recorded) unless EDGEMOE_DEVICE_IDS forces one."""
    _phase("ids", "import")
    from ..runtime import device_ids, native

    if rpc:
        _phase("ids", "rpc")
        native.rpc_loopback_device()
    _phase("ids", "self-test")
    return {"devices": device_ids.as_dicts(device_ids.resolve("auto", fresh=True))}


def _inject_prefill_fault(fault: str) -> None:
    """EDGEMOE_DOCTOR_FAULT=cli:prefill[:wrong]: a fault only in a multi-token ubatch with an expert cache."""
    from ..runtime.sequence import KVSequence

    decode_chunk = KVSequence.decode_chunk

    def faulty(self: KVSequence, mem: Any, chunk: Sequence[int], all_logits: bool, *, last: bool) -> None:
        multi = len(chunk) > 1 and self.routing.experts is not None
        if multi and fault == "cli:prefill":
            _crash()
        decode_chunk(self, mem, chunk, all_logits, last=last)
        if multi and last and fault == "cli:prefill:wrong":
            row = self.logits(-1)
            best = max(range(len(row)), key=row.__getitem__)
            row[best] = min(row)  # the greedy token changes, as a wrong expert row's output would

    KVSequence.decode_chunk = faulty  # type: ignore[method-assign]


def cli_generate(argv: list[str], rpc: bool) -> dict[str, Any]:
    """`edgemoe generate ... --json` run as `python -m edgemoe.cli` runs it; its JSON, on which device."""
    _phase("cli", "import")
    from ..runtime import native

    if rpc:
        _phase("cli", "rpc")
        native.rpc_loopback_device()
    fault = os.environ.get("EDGEMOE_DOCTOR_FAULT", "")
    if fault.startswith("cli:prefill"):
        _inject_prefill_fault(fault)
    gpu = native.gpu_device()
    _phase("cli", "generate")
    out = io.StringIO()  # the CLI's own output; llama.cpp's threads write to fd 1 beside it
    sys.argv = ["edgemoe", "generate", *argv]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("edgemoe.cli", run_name="__main__", alter_sys=True)
        except SystemExit as err:
            if err.code not in (None, 0):
                raise  # the CLI's own message is the last line of stderr
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    cache = result.get("cache")
    return {
        "device": native.device_name(gpu) if gpu is not None and cache is not None else "CPU",
        "prompt_tokens": len(result["prompt_tokens"]),
        "tokens": result["tokens"],
        "cache": None if cache is None else {k: cache[k] for k in ("hits", "misses") if k in cache},
    }


def run(step: dict[str, Any]) -> dict[str, Any]:
    kind = step["kind"]
    if kind == "build":
        return build_info()
    if kind == "devices":
        return device_info()
    if kind == "generate":
        return generate(step["model"], int(step["n_gpu_layers"]), bool(step.get("rpc")))
    if kind == "cli":
        return cli_generate(list(step["argv"]), bool(step.get("rpc")))
    if kind == "device-ids":
        return device_ids_info(bool(step.get("rpc")))
    raise ValueError(f"unknown doctor step {kind!r}")


def main(argv: list[str]) -> int:
    result = run(json.loads(argv[1]))
    text = json.dumps(result)
    if len(argv) > 2:  # the parent's result file, written whole or not at all
        tmp = argv[2] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, argv[2])
    print("RESULT " + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
