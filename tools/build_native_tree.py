#!/usr/bin/env python3
"""Build the patched llama.cpp with plain CMake into a build directory of its own, outside any venv.

Two variants, both outside the default CI (they take long on a small machine):

``asan``
    AddressSanitizer + UndefinedBehaviorSanitizer, CPU and RPC backends, -O1 -g. The libraries land in
    ``.build/cmake-asan/bin``; ``tools/asan_pytest.sh`` runs pytest against them with an unchanged venv
    (``LLAMA_CPP_LIB_PATH`` points llama-cpp-python at them, libasan is preloaded into Python).
``cuda-check``
    The whole tree with the CUDA backend for one architecture (sm_89 by default), FlashAttention kernels
    off, against the CUDA runtime and cuBLAS wheels from PyPI (installed under ``.build/cuda-wheels``)
    and the toolkit's ``nvcc``; links libllama. No driver is needed: the link uses the toolkit's stub
    ``libcuda.so`` when there is one, else a stub generated from ``cuda.h``'s prototypes (what NVIDIA's
    stub is), and every library is linked with ``-Wl,--no-undefined``. It proves the series compiles and
    links for CUDA; nothing is run on a GPU.

Both reuse tools/build_llama.py's steps (pinned sdist, checked sha256, the patch series) on a source tree
of their own (``.build/src-<variant>``), so they never disturb the normal build. The wall time, the load
average before and after, and the CMake arguments are written to ``.build/<variant>-report.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_llama as bl  # noqa: E402
import cxx_runtime  # noqa: E402

BUILD_ROOT = bl.ROOT / ".build"
# llama.cpp's own switches; everything else of the normal build's trimming applies unchanged
COMMON_ARGS = [a for a in bl.TRIM_CMAKE_ARGS if not a.startswith("-DLLAVA")] + [
    "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_COMMON=OFF", "-G", "Ninja"]
ASAN_ARGS = [
    "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
    "-DLLAMA_SANITIZE_ADDRESS=ON", "-DLLAMA_SANITIZE_UNDEFINED=ON",
    "-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON",
    # -O1 keeps the reports' stacks readable; -fno-sanitize-recover is not used: every report is wanted
    f"-DCMAKE_C_FLAGS={bl.NO_AMX_FLAGS} -O1 -g", f"-DCMAKE_CXX_FLAGS={bl.NO_AMX_FLAGS} -O1 -g",
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g", "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g",
    "-DGGML_NATIVE=ON",
]
# the runtime of the toolkit's nvcc (13.0) and the cuBLAS of that release: newer runtime headers do not
# match nvcc 13.0's own
CUDA_WHEELS = ["nvidia-cuda-runtime==13.0.*", "nvidia-cublas==13.0.*"]
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"


def log(msg: str) -> None:
    print(f"[build-native-tree] {msg}", flush=True)


def file_stamps(root: Path) -> dict[str, tuple[str, int]]:
    """(sha256, mtime_ns) of every file under root, by relative path; {} when root does not exist."""
    stamps: dict[str, tuple[str, int]] = {}
    if not root.exists():
        return stamps
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and ".git" not in path.relative_to(root).parts:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            stamps[str(path.relative_to(root))] = (digest, path.stat().st_mtime_ns)
    return stamps


def keep_unchanged_mtimes(root: Path, before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> int:
    """Give every file whose bytes equal the previous tree's (`before`, `after`: file_stamps of the two trees) its
    previous mtime back, so that ninja rebuilds only what the series changed (a fresh `git am` stamps every
    patched file, ggml.h included, and ggml.h alone would recompile every CUDA kernel). Returns how many files
    kept their mtime."""
    kept = 0
    for rel, (digest, old_mtime) in before.items():
        if rel in after and after[rel][0] == digest:
            os.utime(root / rel, ns=(old_mtime, old_mtime))
            kept += 1
    return kept


def patched_source(variant: str) -> Path:
    """A fresh patched source tree for this variant, from the pinned sdist; files whose bytes did not change
    since the last run keep their mtimes (the build directory is reused)."""
    tarball = bl.fetch_sdist(BUILD_ROOT / "sdist", sys.executable)
    llama_rel = Path(bl.SDIST_NAME) / "vendor" / "llama.cpp"
    before = file_stamps(BUILD_ROOT / f"src-{variant}" / llama_rel)
    src = bl.unpack(tarball, BUILD_ROOT / f"src-{variant}")
    bl.apply_series(src, bl.read_series(bl.ROOT / "patches"))
    llama_dir = src / "vendor" / "llama.cpp"
    if before:
        after = file_stamps(llama_dir)
        changed = sorted(rel for rel, (digest, _) in after.items() if before.get(rel, ("",))[0] != digest)
        kept = keep_unchanged_mtimes(llama_dir, before, after)
        log(f"{kept} files unchanged since the last {variant} tree; {len(changed)} changed or new: "
            + ", ".join(changed[:12]) + (" ..." if len(changed) > 12 else ""))
    return llama_dir


def cuda_wheels_root(python: str) -> Path:
    """Install the CUDA runtime and cuBLAS wheels into .build/cuda-wheels; return their nvidia/ folder."""
    target = BUILD_ROOT / "cuda-wheels"
    nvidia = target / "nvidia"
    if not any(nvidia.glob("*/lib/libcublas.so*")):
        log(f"installing {' '.join(CUDA_WHEELS)} into {target}")
        cmd = [python, "-m", "pip", "install", "-q", "--target", str(target), *CUDA_WHEELS]
        if subprocess.run(cmd).returncode != 0:
            raise bl.BuildError("pip could not install the CUDA runtime and cuBLAS wheels; check the "
                                "network/PyPI")
    return nvidia


def wheel_dirs(nvidia: Path, name: str) -> tuple[Path, Path]:
    """(include, lib) of one nvidia wheel; CUDA 13 wheels put everything under nvidia/cu13/."""
    for base in (nvidia / "cu13", nvidia / name):
        if (base / "include").exists() and (base / "lib").exists():
            return base / "include", base / "lib"
    raise bl.BuildError(f"no include/ and lib/ found for {name} under {nvidia}; the wheel layout changed")


def stub_libcuda(cuda_h: Path) -> Path:
    """A libcuda.so.1 stub exporting every driver function cuda.h declares (each returns an error), for a
    machine with a toolkit but no driver: the link resolves against it, a real driver replaces it at run time."""
    out = BUILD_ROOT / "cuda-stub" / "libcuda.so"
    pre = subprocess.run(["gcc", "-E", "-P", f"-I{cuda_h.parent}", str(cuda_h)], capture_output=True, text=True)
    names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", pre.stdout)))
    if pre.returncode != 0 or not names:
        raise bl.BuildError(f"could not read the driver API from {cuda_h}: {pre.stderr[-500:]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text("".join(f"int {n}(void) {{ return 999; }}\n" for n in names))  # 999: CUDA_ERROR_UNKNOWN
    cc = ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)]
    if subprocess.run(cc).returncode != 0:
        raise bl.BuildError(f"could not compile the stub {src}")
    log(f"generated a stub libcuda with {len(names)} driver functions from {cuda_h}")
    return out


def cuda_args(nvcc: str, arch: str, nvidia: Path) -> list[str]:
    """CMake arguments for the CUDA check: the toolkit's nvcc, the wheels' runtime and cuBLAS."""
    toolkit = Path(nvcc).resolve().parent.parent
    _, rt_lib = wheel_dirs(nvidia, "cuda_runtime")
    blas_inc, blas_lib = wheel_dirs(nvidia, "cublas")
    cudart = sorted(rt_lib.glob("libcudart.so*"))
    cublas = sorted(blas_lib.glob("libcublas.so*"))
    cublaslt = sorted(blas_lib.glob("libcublasLt.so*"))
    stub = toolkit / "lib64" / "stubs" / "libcuda.so"
    if not stub.exists():
        stub = next(iter(sorted(toolkit.glob("targets/*/lib/stubs/libcuda.so"))), stub)
    if not stub.exists():
        stub = stub_libcuda(toolkit / "include" / "cuda.h")
    if not (cudart and cublas and cublaslt and stub.exists()):
        raise bl.BuildError(f"missing CUDA libraries: cudart {cudart}, cublas {cublas}, cublasLt {cublaslt}, "
                            f"stub libcuda {stub}")
    # one C++ compiler and the shared libstdc++ for the CUDA link too (docs/build.md, "The C++ runtime")
    host, runtime_dir = cxx_runtime.cuda_host_args()
    link_flags = " ".join(filter(None, [runtime_dir, f"-L{rt_lib}", f"-L{blas_lib}", f"-L{stub.parent}"]))
    return [*host,
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
        f"-DCMAKE_C_FLAGS={bl.NO_AMX_FLAGS}",
        "-DGGML_CUDA=ON", "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF", f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
        f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCUDAToolkit_ROOT={toolkit}",
        # the runtime and cuBLAS the binary links are the wheels' (what a pip install ships), not the toolkit's
        f"-DCUDA_cudart_LIBRARY={cudart[-1]}", f"-DCUDA_cublas_LIBRARY={cublas[-1]}",
        f"-DCUDA_cublasLt_LIBRARY={cublaslt[-1]}", f"-DCUDA_cuda_driver_LIBRARY={stub}",
        f"-DCMAKE_SHARED_LINKER_FLAGS={link_flags} -Wl,--no-undefined",
        # cuBLAS's headers come with its wheel (the toolkit here has the compiler and the runtime only)
        f"-DCMAKE_CUDA_FLAGS=-I{blas_inc}", f"-DCMAKE_CXX_FLAGS={bl.NO_AMX_FLAGS} -I{blas_inc}",
    ]


def run_build(variant: str, extra: list[str], jobs: int) -> dict:
    llama_dir = patched_source(variant)
    build_dir = BUILD_ROOT / f"cmake-{variant}"
    logfile = BUILD_ROOT / f"build-{variant}.log"
    args = COMMON_ARGS + extra
    load0 = os.getloadavg()
    t0 = time.time()
    with logfile.open("w") as logf:
        for cmd in (["cmake", "-S", str(llama_dir), "-B", str(build_dir), *args],
                    ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", "llama", "ggml-rpc"]):
            log(" ".join(cmd[:4]) + " ...")
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            if subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT).returncode != 0:
                tail = logfile.read_text().splitlines()[-30:]
                raise bl.BuildError(f"the {variant} build failed; last lines of {logfile}:\n" + "\n".join(tail))
    report = {"variant": variant, "wall_s": round(time.time() - t0, 1), "jobs": jobs,
              "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cmake_args": args,
              "libs": sorted(p.name for p in (build_dir / "bin").glob("lib*.so*"))}
    (BUILD_ROOT / f"{variant}-report.json").write_text(json.dumps(report, indent=1))
    log(f"{variant}: built in {report['wall_s']:.0f} s with -j{jobs}; libraries in {build_dir / 'bin'}")
    check_built_libraries(build_dir, logfile, cuda=variant == "cuda-check")
    return report


def check_built_libraries(build_dir: Path, logfile: Path, *, cuda: bool) -> None:
    """The C++ runtime check over build_dir/bin's libraries (docs/build.md, "The C++ runtime"); for a CUDA
    tree the ggml-cuda link is reported into the log first."""
    try:
        log(cxx_runtime.check_build(build_dir / "bin", logfile=logfile, cuda_build_dir=build_dir if cuda else None))
    except cxx_runtime.CxxRuntimeError as err:
        raise bl.BuildError(str(err)) from None


def check_cuda_link(build_dir: Path) -> None:
    """libllama and libggml-cuda must exist and name the CUDA runtime and cuBLAS among their needs."""
    cuda_lib = build_dir / "bin" / "libggml-cuda.so"
    if not cuda_lib.exists() or not (build_dir / "bin" / "libllama.so").exists():
        raise bl.BuildError(f"{cuda_lib} or libllama.so is missing after the build")
    needed = subprocess.run(["readelf", "-d", str(cuda_lib)], capture_output=True, text=True).stdout
    for lib in ("libcudart", "libcublas"):
        if lib not in needed:
            raise bl.BuildError(f"{cuda_lib.name} does not link {lib}: {needed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=["asan", "cuda-check"])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--cuda-arch", default="89", help="CMAKE_CUDA_ARCHITECTURES for cuda-check")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", DEFAULT_NVCC))
    args = ap.parse_args(argv)
    try:
        if args.variant == "asan":
            run_build("asan", ASAN_ARGS, args.jobs)
        else:
            if not Path(args.nvcc).exists():
                raise bl.BuildError(f"no nvcc at {args.nvcc}; install the CUDA toolkit or pass --nvcc")
            extra = cuda_args(args.nvcc, args.cuda_arch, cuda_wheels_root(sys.executable))
            run_build("cuda-check", extra, args.jobs)
            check_cuda_link(BUILD_ROOT / "cmake-cuda-check")
    except bl.BuildError as err:
        print(f"[build-native-tree] error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
