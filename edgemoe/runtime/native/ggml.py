"""ggml's devices, buffer types, type ids and the RPC stand-in device, from the ggml libraries libllama loaded."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from ...errors import NativeLibraryError
from .loader import (
    GgmlBufferType,
    GgmlDevice,
    declare,
    ggml_base_lib,
    ggml_cpu_lib,
    ggml_lib,
    require_ggml_functions,
)
from .structs import BackendFeature, DevProps, TensorBuftOverride

# -- ggml device and buffer-type lookups (libggml / libggml-cpu beside libllama) ------------------------
# enum ggml_backend_dev_type (ACCEL 2, IGPU 3)
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1


# ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
_dev_by_type = declare("ggml_backend_dev_by_type", [ctypes.c_int], ctypes.c_void_p, ggml_lib)
# const char * ggml_backend_dev_name(ggml_backend_dev_t device);
_dev_name = declare("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p, ggml_lib)
# void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
_dev_memory = declare(
    "ggml_backend_dev_memory",
    [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    None,
    ggml_lib,
)
# ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
_cpu_buft = declare("ggml_backend_cpu_buffer_type", [], ctypes.c_void_p, ggml_cpu_lib)


# -- a graph node's name and contents, for llama.cpp's eval callback (edgemoe.runtime.node_probe) -----------
# const char * ggml_get_name(const struct ggml_tensor * tensor);
_get_name = declare("ggml_get_name", [ctypes.c_void_p], ctypes.c_char_p, ggml_base_lib)
# size_t ggml_nbytes(const struct ggml_tensor * tensor);
_nbytes = declare("ggml_nbytes", [ctypes.c_void_p], ctypes.c_size_t, ggml_base_lib)
# void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
_tensor_get = declare(
    "ggml_backend_tensor_get",
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t],
    None,
    ggml_base_lib,
)


def tensor_name(tensor: int) -> str:
    require_ggml_functions(_get_name, caller="the node probe")
    return (_get_name(tensor) or b"").decode(errors="replace")


def tensor_f32(tensor: int) -> np.ndarray:
    """A contiguous F32 tensor's values, flat (copied from whichever backend holds it)."""
    require_ggml_functions(_nbytes, _tensor_get, caller="the node probe")
    out = np.empty(_nbytes(tensor) // 4, np.float32)
    _tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
    return out


def device_by_type(kind: int) -> GgmlDevice | None:
    """The first device of a ggml_backend_dev_type (GGML_BACKEND_DEVICE_TYPE_CPU, _GPU), None if none."""
    dev = _dev_by_type(kind) if _dev_by_type is not None else None
    return GgmlDevice(dev) if dev else None


def reg_proc_address(reg: int, name: bytes) -> int | None:
    """ggml_backend_reg_get_proc_address: a backend's optional function by name (None: absent)."""
    return _reg_proc(reg, name) if _reg_proc is not None else None


def cpu_buffer_type() -> GgmlBufferType | None:
    """ggml_backend_cpu_buffer_type(), None in a ggml without it."""
    buft = _cpu_buft() if _cpu_buft is not None else None
    return GgmlBufferType(buft) if buft else None


def gpu_device() -> GgmlDevice | None:
    """The first GPU device of this build (a ggml_backend_dev_t), None in a CPU-only build."""
    return device_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)


def device_name(dev: GgmlDevice) -> str:
    return _dev_name(dev).decode() if _dev_name is not None else "?"


def device_memory(dev: GgmlDevice) -> tuple[int, int]:
    """(free, total) bytes of a device."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


# ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
_reg_by_name = declare("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p, ggml_lib)
# void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
_reg_proc = declare(
    "ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p, ggml_lib
)
# void ggml_backend_register(ggml_backend_reg_t reg);
_register = declare("ggml_backend_register", [ctypes.c_void_p], None, ggml_lib)
# ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
_reg_dev_get = declare(
    "ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p, ggml_lib
)
# size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
_reg_dev_count = declare("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t, ggml_lib)

# void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
#                                    size_t n_devices, ggml_backend_dev_t * devices);
_RpcStartServer = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
)
# ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
_RpcAddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


def _rpc_server(port: int, n_threads: int) -> tuple[int, Callable[[], None]]:
    """The RPC registry and a call that serves this process's CPU backend on 127.0.0.1:port (blocking)."""
    reg = _reg_by_name(b"RPC") if _reg_by_name is not None else None
    if not reg:
        raise NativeLibraryError("llama.cpp was built without the RPC backend: run `make install`")
    start = _RpcStartServer(_reg_proc(reg, b"ggml_backend_rpc_start_server"))
    cpu = _dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    endpoint = f"127.0.0.1:{port}".encode()
    devs = (ctypes.c_void_p * 1)(cpu)
    return reg, lambda: start(endpoint, None, n_threads, 1, devs)


def serve_rpc(port: int, n_threads: int = 1) -> None:
    """Serve this process's CPU backend as llama.cpp's RPC server on 127.0.0.1:port, until the process ends (one
    client at a time): a device for other processes (test-backend-ops --rpc)."""
    _rpc_server(port, n_threads)[1]()


def rpc_loopback_device(port: int | None = None, n_threads: int = 1) -> GgmlDevice:
    """Start llama.cpp's RPC server on 127.0.0.1:port (None: a free port) in this process (serving the CPU
    backend from a daemon thread), register it, and return its device: a GPU-type device with its own
    buffers, async copies and events, reached over loopback. For tests of the cache's device paths without
    a GPU. Every model loaded afterwards in this process sees the device (run it in a process of its own).
    """
    import socket
    import threading
    import time

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])

    reg, serve = _rpc_server(int(port), n_threads)
    add = _RpcAddServer(_reg_proc(reg, b"ggml_backend_rpc_add_server"))
    endpoint = f"127.0.0.1:{port}".encode()
    threading.Thread(target=serve, daemon=True).start()
    time.sleep(0.3)  # the server binds its socket
    server = add(endpoint)
    if not server or _reg_dev_count(server) < 1:
        raise NativeLibraryError(f"no RPC device at {endpoint.decode()}")
    _register(server)
    return GgmlDevice(int(_reg_dev_get(server, 0)))


def cpu_overrides(patterns: list[str]) -> ctypes.Array[TensorBuftOverride]:
    """A NULL-terminated override list putting tensors matching the regexes in plain CPU buffers."""
    if _cpu_buft is None:
        raise NativeLibraryError(
            "libggml-cpu does not export ggml_backend_cpu_buffer_type: run `make install`"
        )
    arr = (TensorBuftOverride * (len(patterns) + 1))()
    for i, p in enumerate(patterns):
        arr[i].pattern = p.encode()
        arr[i].buft = _cpu_buft()
    return arr


# -- ggml contexts, graphs, buffers and backends (edgemoe.perf.measure.microbench's microbenchmarks) -----------------
# enum ggml_type (ggml/include/ggml.h): the ids of the types the microbenchmarks build weights of
GGML_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "IQ2_XXS": 16,
    "IQ2_XS": 17,
    "IQ3_XXS": 18,
    "IQ1_S": 19,
    "IQ4_NL": 20,
    "IQ3_S": 21,
    "IQ2_S": 22,
    "IQ4_XS": 23,
    "I8": 24,
    "I32": 26,
    "IQ1_M": 29,
    "BF16": 30,
    "MXFP4": 39,
}
GGML_TYPE_F32 = GGML_TYPES["F32"]
GGML_TYPE_I32 = GGML_TYPES["I32"]
GGML_TYPE_I8 = GGML_TYPES["I8"]


# const char * ggml_version(void);
_ggml_version = declare("ggml_version", [], ctypes.c_char_p, ggml_base_lib)
# const char * ggml_commit(void);
_ggml_commit = declare("ggml_commit", [], ctypes.c_char_p, ggml_base_lib)
# size_t ggml_backend_reg_count(void);
_reg_count = declare("ggml_backend_reg_count", [], ctypes.c_size_t, ggml_lib)
# ggml_backend_reg_t ggml_backend_reg_get(size_t index);
_reg_get = declare("ggml_backend_reg_get", [ctypes.c_size_t], ctypes.c_void_p, ggml_lib)
# const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
_reg_name = declare("ggml_backend_reg_name", [ctypes.c_void_p], ctypes.c_char_p, ggml_base_lib)
# size_t ggml_backend_dev_count(void);
_dev_count = declare("ggml_backend_dev_count", [], ctypes.c_size_t, ggml_lib)
# ggml_backend_dev_t ggml_backend_dev_get(size_t index);
_dev_get = declare("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p, ggml_lib)
# void ggml_backend_dev_get_props(ggml_backend_dev_t device, struct ggml_backend_dev_props * props);
_dev_get_props = declare(
    "ggml_backend_dev_get_props", [ctypes.c_void_p, ctypes.POINTER(DevProps)], None, ggml_base_lib
)
# ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
_dev_reg = declare("ggml_backend_dev_backend_reg", [ctypes.c_void_p], ctypes.c_void_p, ggml_base_lib)
# typedef struct ggml_backend_feature * (*ggml_backend_get_features_t)(ggml_backend_reg_t reg);
_GetFeatures = ctypes.CFUNCTYPE(ctypes.POINTER(BackendFeature), ctypes.c_void_p)


def ggml_version() -> tuple[str, str]:
    """(ggml's version, the commit it was built from: "unknown" for a source tree without git)."""
    version = _ggml_version().decode() if _ggml_version is not None else "?"
    commit = _ggml_commit().decode() if _ggml_commit is not None else "?"
    return version, commit


def backend_registries() -> list[tuple[str, dict[str, str]]]:
    """Each registered ggml backend's name with its build features (CPU: AVX2, ...; CUDA: ARCHS, ...)."""
    require_ggml_functions(_reg_count, _reg_get, _reg_name, _reg_proc, caller="`edgemoe doctor`")
    out: list[tuple[str, dict[str, str]]] = []
    for i in range(_reg_count()):
        reg = _reg_get(i)
        features: dict[str, str] = {}
        proc = _reg_proc(reg, b"ggml_backend_get_features")
        if proc:
            arr = _GetFeatures(proc)(reg)
            j = 0
            while arr and arr[j].name:
                features[arr[j].name.decode()] = (arr[j].value or b"").decode()
                j += 1
        out.append((_reg_name(reg).decode(), features))
    return out


def device_registry(dev: int) -> str:
    """The name of the registry a device belongs to ("CUDA", "RPC[127.0.0.1:50052]", ...), "" if unknown."""
    if _dev_reg is None or _reg_name is None:
        return ""
    reg = _dev_reg(dev)
    return _reg_name(reg).decode() if reg else ""


def devices() -> list[tuple[int, DevProps]]:
    """Every device ggml sees (handle, properties with free and total memory), CPU included."""
    require_ggml_functions(_dev_count, _dev_get, _dev_get_props, caller="`edgemoe doctor`")
    out: list[tuple[int, DevProps]] = []
    for i in range(_dev_count()):
        dev = _dev_get(i)
        props = DevProps()
        _dev_get_props(dev, ctypes.byref(props))
        out.append((int(dev), props))
    return out
