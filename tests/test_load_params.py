"""The parameters Engine hands llama.cpp, byte for byte against stock llama-cpp-python's for the same file.

The only GPU run (docs/build.md) crashed in llama_model_load_from_file for every Engine load while stock
`Llama(n_gpu_layers=-1)` ran on the same library. Both calls are intercepted here in one process and the
structs compared field by field: any difference in the model parameters (pointers, overrides, devices,
callbacks, use_extra_bufts, load_mode) would be a candidate cause; the context's few deliberate differences
are listed with their reason.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.models import FIXTURE_MODELS

HERE = Path(__file__).resolve().parent

# context fields where Engine deliberately keeps llama.cpp's own default (from the model's metadata /
# -1 "unset") while llama-cpp-python's Llama writes its own constants; none is read while loading
CONTEXT_DIFFERENCES = {
    "yarn_attn_factor": (-1.0, 1.0),  # llama.cpp: -1 = the model's value; Llama: 1.0
    "yarn_beta_fast": (-1.0, 32.0),
    "yarn_beta_slow": (-1.0, 1.0),
    "no_perf": (True, False),  # llama.cpp's default; Llama turns the perf counters on
    "flash_attn_type": (-1, 0),  # the Engine: llama.cpp's default auto; Llama: off unless flash_attn=True
}


def _fields(struct: ctypes.Structure) -> dict[str, Any]:
    """Field name -> value, pointers and callbacks as addresses (None = NULL)."""
    out: dict[str, Any] = {}
    for name, ctype, *_ in struct._fields_:
        value = getattr(struct, name)
        if issubclass(ctype, (ctypes._Pointer, ctypes._CFuncPtr, ctypes.c_void_p)):  # type: ignore[attr-defined]
            value = ctypes.cast(value, ctypes.c_void_p).value if value is not None else None
        out[name] = value
    return out


def _field_bytes(struct: ctypes.Structure) -> dict[str, bytes]:
    """Each field's raw bytes (a bool's byte, a pointer's 8); the padding between fields is left out: it is
    uninitialised in the struct llama_model_default_params returns, and llama.cpp never reads it."""
    base = ctypes.addressof(struct)
    out: dict[str, bytes] = {}
    for name, ctype, *_ in struct._fields_:
        offset = getattr(type(struct), name).offset
        out[name] = ctypes.string_at(base + offset, ctypes.sizeof(ctype))
    return out


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[ctypes.Structure]]:
    """The model and context params of every llama_model_load_from_file / llama_init_from_model call."""
    from edgemoe.runtime.native import lib

    calls: dict[str, list[ctypes.Structure]] = {"model": [], "context": []}
    load, init = lib.llama_model_load_from_file, lib.llama_init_from_model

    def rec_load(path: bytes, params: ctypes.Structure) -> Any:
        calls["model"].append(type(params).from_buffer_copy(params))
        return load(path, params)

    def rec_init(model: Any, params: ctypes.Structure) -> Any:
        calls["context"].append(type(params).from_buffer_copy(params))
        return init(model, params)

    # llama_cpp.Llama calls the same module attributes as Engine does
    monkeypatch.setattr(lib, "llama_model_load_from_file", rec_load)
    monkeypatch.setattr(lib, "llama_init_from_model", rec_init)
    return calls


@pytest.mark.parametrize("n_gpu_layers", [0, 999])
def test_engine_params_equal_stock_llama(fixture_model: Path, recorded: dict, n_gpu_layers: int) -> None:
    import llama_cpp

    from edgemoe.runtime.engine import Engine, LoadConfig

    with Engine(fixture_model, LoadConfig(n_ctx=256, n_threads=2, n_gpu_layers=n_gpu_layers)):
        pass
    llm = llama_cpp.Llama(model_path=str(fixture_model), n_ctx=256, n_threads=2, n_threads_batch=2,
                          n_gpu_layers=n_gpu_layers, verbose=False)
    llm.close()
    (eng_m, stock_m), (eng_c, stock_c) = recorded["model"], recorded["context"]
    assert _fields(eng_m) == _fields(stock_m)
    assert _field_bytes(eng_m) == _field_bytes(stock_m)
    assert _fields(eng_m)["devices"] is None and _fields(eng_m)["tensor_buft_overrides"] is None
    e, s = _fields(eng_c), _fields(stock_c)
    diff = {k: (e[k], s[k]) for k in e if e[k] != s[k]}
    assert diff == CONTEXT_DIFFERENCES


def test_cpu_expert_override_list_is_llama_cpps_own(recorded: dict) -> None:
    """The bench's GPU layout (-ot exps=CPU): a NULL-terminated list whose buffer type is the CPU device's,
    from the libggml-cpu libllama loaded, kept alive by the Engine for the model's lifetime."""
    from edgemoe.perf.measure import ggml_graph
    from edgemoe.runtime import native
    from edgemoe.runtime.engine import Engine, LoadConfig

    path = FIXTURE_MODELS[0]
    with Engine(path, LoadConfig(n_ctx=256, n_threads=2, n_gpu_layers=999, cpu_expert_layers=(0, 1))) as eng:
        params = recorded["model"][0]
        addr = _fields(params)["tensor_buft_overrides"]
        assert addr == ctypes.addressof(eng.handle.buft_overrides)
        entries = (native.TensorBuftOverride * 3).from_address(addr)
        assert entries[0].pattern == rb"^blk\.(0|1)\.ffn_(gate_up|up|gate|down)_exps"
        assert entries[0].buft == ggml_graph.device_buffer_type(ggml_graph.cpu_device())
        assert entries[1].pattern is None and entries[1].buft is None  # the terminator
        assert _fields(params)["kv_overrides"] is None


def test_each_native_library_is_mapped_once() -> None:
    """libllama's ggml libraries are mapped from one file each: pip installs libggml.so, .so.0 and .so.0.x.y as
    copies, and a second copy would hold a second device registry and log/abort callbacks of its own."""
    code = ("import sys; from edgemoe.runtime import native; from edgemoe.runtime.engine import Engine, LoadConfig\n"
            f"e = Engine({str(FIXTURE_MODELS[0])!r}, LoadConfig(n_ctx=128, n_threads=1)); e.close()\n"
            "print(open('/proc/self/maps').read())")
    maps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    assert maps.returncode == 0, maps.stderr[-2000:]
    files: dict[str, set[str]] = {}
    for line in maps.stdout.splitlines():
        parts = line.split()
        if len(parts) < 6:  # an anonymous mapping
            continue
        path = parts[-1]
        name = Path(path).name
        for lib in ("libllama", "libggml-base", "libggml-cpu", "libggml-rpc", "libggml-cuda", "libggml"):
            if name.startswith(lib + ".so"):
                files.setdefault(lib, set()).add(path)
                break
    assert {"libllama", "libggml", "libggml-base", "libggml-cpu"} <= set(files), files
    assert all(len(paths) == 1 for paths in files.values()), files
