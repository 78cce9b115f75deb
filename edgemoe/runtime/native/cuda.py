"""The CUDA runtime and the NVIDIA driver as `edgemoe doctor` reports them: versions and the GPU's PCIe link."""

from __future__ import annotations

import ctypes
import os


def _loaded_library(prefix: str) -> str | None:
    """The path of a shared library already mapped into this process whose file name starts with prefix."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/" in path and os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def cuda_versions() -> tuple[int, int] | None:
    """(driver, runtime) versions as the CUDA runtime ggml-cuda loaded reports them (12040 = 12.4); the
    driver's is 0 without a driver; None in a build without CUDA."""
    path = _loaded_library("libcudart.so")
    if path is None:
        return None
    cudart = ctypes.CDLL(path)  # already mapped: the same object
    # cudaError_t cudaDriverGetVersion(int * driverVersion); cudaError_t cudaRuntimeGetVersion(int * runtimeVersion);
    driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
    cudart.cudaDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    cudart.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    cudart.cudaDriverGetVersion(ctypes.byref(driver))
    cudart.cudaRuntimeGetVersion(ctypes.byref(runtime))
    return int(driver.value), int(runtime.value)


def nvml_pcie(pci_bus_id: str) -> dict[str, object] | None:
    """The NVIDIA driver's version and a GPU's PCIe link (current and maximum generation and width) from NVML,
    found by PCI bus id; None without the driver's libnvidia-ml or when NVML does not know the device."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    # nvmlReturn_t nvmlInit_v2(void); nvmlReturn_t nvmlSystemGetDriverVersion(char * version, unsigned int length);
    # nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char * pciBusId, nvmlDevice_t * device);
    # nvmlReturn_t nvmlDeviceGet{Curr,Max}PcieLink{Generation,Width}(nvmlDevice_t device, unsigned int * value);
    if nvml.nvmlInit_v2() != 0:
        return None
    version = ctypes.create_string_buffer(96)
    nvml.nvmlSystemGetDriverVersion(version, ctypes.c_uint(96))
    handle = ctypes.c_void_p()
    out: dict[str, object] = {"driver": version.value.decode()}
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) == 0:
        for key, fn in (
            ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            value = ctypes.c_uint(0)
            if getattr(nvml, fn)(handle, ctypes.byref(value)) == 0:
                out[key] = int(value.value)
    nvml.nvmlShutdown()
    return out
