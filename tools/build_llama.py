#!/usr/bin/env python3
"""Build the patched llama-cpp-python into a virtual environment.

Steps: fetch the pinned llama-cpp-python sdist with pip, check its sha256,
unpack it, make ``vendor/llama.cpp`` a git repository whose first commit is the
sdist's source and apply ``patches/series`` with ``git am -3`` (stopping at the
first patch that does not merge, with what to do), then ``pip install`` it with a trimmed
CMake configuration (no server, tools, examples, tests or multimodal).

A stamp in the venv records sdist + patches + options; when they are
unchanged nothing is rebuilt. The CMake build directory is kept under
``.build/`` so a changed patch recompiles only what it touches.

CPU by default; ``--cuda`` or ``EDGEMOE_CUDA=1`` builds the CUDA backend,
``--cuda-arch`` / ``EDGEMOE_CUDA_ARCH`` picks the architectures (e.g. "90").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cxx_runtime  # noqa: E402
import llama_git  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))
from edgemoe.runtime.op_tests import BACKEND_OPS_NAME, NATIVE_TOOLS_DIR  # noqa: E402  (stdlib only)

SDIST_NAME = "llama_cpp_python-0.3.36"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
STAMP_NAME = ".edgemoe-llama-stamp.json"
# a tarball trimmed by tools/device_pack.py holds this file with the sha256 of the sdist it came from
TRIM_MARKER = "EDGEMOE_TRIMMED_FROM"
# llama-cpp-python's own runtime requirements (its pyproject) and our build backend;
# installed first because the package itself is installed with --no-deps.
SDIST_REQUIREMENTS = ["typing-extensions>=4.5.0", "numpy>=1.20.0", "diskcache>=5.6.1",
                      "jinja2>=2.11.3", "scikit-build-core>=0.9.2"]

# Parts of llama.cpp we never use; leaving them out keeps the build short.
TRIM_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    # llama.cpp's RPC backend, started in-process on loopback, is the GPU-like stand-in cache device
    # of the CPU-only tests (a device of its own, async copies and events; tests/test_cache_rpc.py)
    "-DGGML_RPC=ON",
]


NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class BuildError(RuntimeError):
    """A build step failed; the message says what to do."""


@dataclass(frozen=True)
class BuildOptions:
    cuda: bool
    cuda_arch: str  # CMAKE_CUDA_ARCHITECTURES, "" = llama.cpp's default
    native: bool  # -march=native for the CPU backend
    extra_cmake: str  # passed through verbatim

    def cmake_args(self) -> list[str]:
        args = list(TRIM_CMAKE_ARGS)
        args.append(f"-DGGML_NATIVE={'ON' if self.native else 'OFF'}")
        # ggml's AMX path (picked by -march=native on Sapphire Rapids) segfaults in
        # mul_mat on our CI machines and repacks weights into its own buffer type,
        # which the expert patches cannot use; keep the AVX-512/AVX2 kernels instead.
        args.append("-DCMAKE_C_FLAGS=" + NO_AMX_FLAGS)
        args.append("-DCMAKE_CXX_FLAGS=" + NO_AMX_FLAGS)
        if self.cuda:
            args.append("-DGGML_CUDA=ON")
            if self.cuda_arch:
                args.append(f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}")
            # one C++ compiler and the shared libstdc++ for the CUDA link too (docs/build.md, "The C++ runtime")
            host, link_flags = cxx_runtime.cuda_host_args(self.extra_cmake.split())
            args += host + ([f"-DCMAKE_SHARED_LINKER_FLAGS={link_flags}"] if link_flags else [])
        if self.extra_cmake:
            args.extend(self.extra_cmake.split())
        return args

    @property
    def variant(self) -> str:
        return "cuda" if self.cuda else "cpu"


def log(msg: str) -> None:
    print(f"[build-llama] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_series(patch_dir: Path) -> list[Path]:
    series = patch_dir / "series"
    if not series.exists():
        raise BuildError(f"{series} is missing; it lists the patches to apply, one per line")
    names = [ln.strip() for ln in series.read_text().splitlines()]
    names = [n for n in names if n and not n.startswith("#")]
    paths = [patch_dir / n for n in names]
    for p in paths:
        if not p.exists():
            raise BuildError(f"patch {p.name} is named in {series} but does not exist")
    return paths


def fetch_sdist(cache: Path, python: str) -> Path:
    """Return the verified sdist tarball, downloading it with pip if needed."""
    env_path = os.environ.get("EDGEMOE_SDIST")
    tarball = Path(env_path) if env_path else cache / f"{SDIST_NAME}.tar.gz"
    if not tarball.exists():
        if env_path:
            raise BuildError(f"EDGEMOE_SDIST={env_path} does not exist")
        cache.mkdir(parents=True, exist_ok=True)
        log(f"downloading llama-cpp-python=={SDIST_VERSION} sdist with pip")
        cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={SDIST_VERSION}", "-d", str(cache)]
        if subprocess.run(cmd).returncode != 0 or not tarball.exists():
            raise BuildError("pip could not download the llama-cpp-python sdist; check the "
                             "network/PyPI, or set EDGEMOE_SDIST=/path/to/" + tarball.name)
    digest = sha256_file(tarball)
    if digest != SDIST_SHA256 and trimmed_from(tarball) == SDIST_SHA256:
        log(f"{tarball.name} is the pinned sdist trimmed by tools/device_pack.py")
        return tarball
    if digest != SDIST_SHA256:
        raise BuildError(f"{tarball} has sha256 {digest}, expected {SDIST_SHA256}; "
                         "delete it and run again")
    return tarball


def trimmed_from(tarball: Path) -> str | None:
    """The sha256 a trimmed tarball's marker names, None for any other tarball."""
    try:
        with tarfile.open(tarball) as tf:
            f = tf.extractfile(f"{SDIST_NAME}/{TRIM_MARKER}")
            return f.read().decode().strip() if f else None
    except (KeyError, tarfile.TarError, OSError):
        return None


def unpack(tarball: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    log(f"unpacking {tarball.name}")
    with tarfile.open(tarball) as tf:
        # Skip llama.cpp's bundled model files and docs: ~110 MB we never use.
        members = [m for m in tf.getmembers()
                   if "/vendor/llama.cpp/models/" not in m.name
                   and "/vendor/llama.cpp/docs/" not in m.name]
        tf.extractall(dest, members=members, filter="data")
    return dest / SDIST_NAME


def apply_series(src: Path, patches: list[Path]) -> None:
    """Make vendor/llama.cpp a repository (first commit: the sdist's source) and `git am -3` the series."""
    llama_dir = src / "vendor" / "llama.cpp"
    try:
        llama_git.init_base(llama_dir, f"{SDIST_NAME} (sha256 {SDIST_SHA256[:12]})")
        llama_git.am_series(llama_dir, patches, log=log, fix_hint=(
            "The build unpacks a fresh tree every run, so fix the patch itself: `python tools/patches.py "
            "init` stops at the same patch in .build/patchwork/llama.cpp; resolve it there, `git am "
            "--continue`, then `python tools/patches.py export` (docs/upgrading-llama.md)."))
    except llama_git.SeriesError as err:
        raise BuildError(str(err)) from None


def stamp_key(patches: list[Path], opts: BuildOptions) -> dict:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return {"sdist_sha256": SDIST_SHA256, "patches_sha256": h.hexdigest(),
            "options": asdict(opts), "cmake_args": opts.cmake_args()}


def installed_ok(python: str) -> bool:
    code = "import llama_cpp.llama_cpp as L, sys; sys.exit(0 if hasattr(L._lib, 'llama_edgemoe_patch_level') else 1)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def check_cxx_runtime(lib: Path, opts: BuildOptions, build_dir: Path | None) -> None:
    """The C++ runtime check over the installed libraries in `lib` (docs/build.md, "The C++ runtime");
    build_dir: the CUDA build's, whose link is reported into the build log first."""
    logfile = ROOT / ".build" / f"build-{opts.variant}.log"
    try:
        log(cxx_runtime.check_build(lib, logfile=logfile, cuda_build_dir=build_dir if opts.cuda else None))
    except cxx_runtime.CxxRuntimeError as err:
        raise BuildError(f"{err}\nrebuild with `python tools/build_llama.py --force` once the cause is fixed") from None


def build(opts: BuildOptions, venv: Path, force: bool) -> None:
    python = str(venv / "bin" / "python")
    if not Path(python).exists():
        raise BuildError(f"no Python at {python}; create the venv first (make venv)")
    patches = read_series(ROOT / "patches")
    key = stamp_key(patches, opts)
    stamp = venv / STAMP_NAME
    if not force and stamp.exists() and json.loads(stamp.read_text()) == key and installed_ok(python):
        log("patched llama-cpp-python is up to date (sdist, patches and options unchanged)")
        lib = installed_lib_dir(python)
        check_cxx_runtime(lib, opts, None)
        llama_dir = ROOT / ".build" / "src" / SDIST_NAME / "vendor" / "llama.cpp"
        if not (venv / NATIVE_TOOLS_DIR / BACKEND_OPS_NAME).exists() and llama_dir.exists():
            install_backend_ops(llama_dir, lib, venv / NATIVE_TOOLS_DIR)  # an older install
        return
    build_root = ROOT / ".build"
    tarball = fetch_sdist(build_root / "sdist", python)
    src = unpack(tarball, build_root / "src")
    apply_series(src, patches)
    deps = subprocess.run([python, "-m", "pip", "install", "-q", *SDIST_REQUIREMENTS])
    if deps.returncode != 0:
        raise BuildError("pip could not install llama-cpp-python's requirements; check the network/PyPI")
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(shlex.quote(a) for a in opts.cmake_args())
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    build_dir = build_root / f"cmake-{opts.variant}"
    cmd = [python, "-m", "pip", "install", "--no-build-isolation", "--force-reinstall",
           "--no-deps", "-C", f"build-dir={build_dir}", str(src)]
    log(f"building ({opts.variant}; CMAKE_ARGS={env['CMAKE_ARGS']})")
    t0 = time.time()
    with (build_root / f"build-{opts.variant}.log").open("w") as logf:
        proc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (build_root / f"build-{opts.variant}.log").read_text().splitlines()[-30:]
        raise BuildError("pip install of the patched llama-cpp-python failed; last lines of "
                         f".build/build-{opts.variant}.log:\n" + "\n".join(tail))
    log(f"built and installed in {time.time() - t0:.0f} s")
    if not installed_ok(python):
        raise BuildError("the installed llama_cpp does not export llama_edgemoe_patch_level; "
                         "the patch series was not compiled in")
    lib = installed_lib_dir(python)
    check_cxx_runtime(lib, opts, build_dir)
    install_backend_ops(src / "vendor" / "llama.cpp", lib, venv / NATIVE_TOOLS_DIR)
    stamp.write_text(json.dumps(key, indent=1))


def installed_lib_dir(python: str) -> Path:
    """llama_cpp/lib of the environment of `python`: the libraries just installed, found without importing
    llama_cpp (which would load them before the C++ runtime check has read them)."""
    code = "import importlib.util as u; print(list(u.find_spec('llama_cpp').submodule_search_locations)[0])"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"llama_cpp is not installed in {python}'s environment: {proc.stderr.strip()[-300:]}")
    return Path(proc.stdout.strip()) / "lib"


def install_backend_ops(llama_dir: Path, lib: Path, dest: Path) -> Path:
    """Compile llama.cpp's tests/test-backend-ops.cpp of the patched tree against the installed libraries in `lib`
    and put it, with the ggml headers, in `dest` (the venv's NATIVE_TOOLS_DIR): doctor's op step and the op tests
    run the series' cases from there (the trimmed build leaves llama.cpp's tests out). About 25 s of one core."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler (g++) to build test-backend-ops (doctor's op step): install g++")
    include = dest / "include"
    shutil.rmtree(include, ignore_errors=True)
    shutil.copytree(llama_dir / "ggml" / "include", include)
    exe = dest / BACKEND_OPS_NAME
    cmd = [cxx, "-std=c++17", "-O1", str(llama_dir / "tests" / "test-backend-ops.cpp"), f"-I{include}",
           f"-L{lib}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(exe)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError("compiling test-backend-ops (doctor's op step) failed:\n" + proc.stderr[-3000:])
    log(f"test-backend-ops and the ggml headers in {dest} ({time.time() - t0:.0f} s)")
    return exe


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--cuda", action="store_true", default=os.environ.get("EDGEMOE_CUDA") == "1",
                    help="build the CUDA backend (also EDGEMOE_CUDA=1)")
    ap.add_argument("--cuda-arch", default=os.environ.get("EDGEMOE_CUDA_ARCH", ""),
                    help="CMAKE_CUDA_ARCHITECTURES, e.g. 90 or '86;89' (also EDGEMOE_CUDA_ARCH)")
    ap.add_argument("--no-native", action="store_true", help="do not build with -march=native")
    ap.add_argument("--cmake-args", default=os.environ.get("EDGEMOE_CMAKE_ARGS", ""),
                    help="extra CMake arguments (also EDGEMOE_CMAKE_ARGS)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = BuildOptions(cuda=args.cuda, cuda_arch=args.cuda_arch, native=not args.no_native,
                        extra_cmake=args.cmake_args)
    try:
        build(opts, args.venv.resolve(), args.force)
    except BuildError as err:
        print(f"[build-llama] error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
