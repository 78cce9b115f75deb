"""The build side of the C++ runtime check (docs/build.md, "The C++ runtime"): the check over built libraries,
the CMake arguments that keep libstdc++ shared in a CUDA link, and a report of that link for the build log.

The check itself is edgemoe/runtime/native/elf.py, loaded by file path: the build runs before edgemoe (and
llama_cpp, which importing edgemoe.runtime.native would load) is installed."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
ELF_PY = ROOT / "edgemoe" / "runtime" / "native" / "elf.py"
_MODULE = "_edgemoe_build_elf"


def elf() -> ModuleType:
    """edgemoe/runtime/native/elf.py as a module of its own (no edgemoe import, no llama_cpp)."""
    if _MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(_MODULE, ELF_PY)
        assert spec is not None and spec.loader is not None, ELF_PY
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[_MODULE]


def library_problems(lib_dir: Path) -> list[str]:
    """The C++ runtime problems of every shared library in lib_dir (one file per library); [] when all pass."""
    mod = elf()
    libs = mod.library_files(lib_dir)
    if not libs:
        return [f"no shared libraries (lib*.so*) in {lib_dir} to check"]
    return mod.check_libraries(libs)


def cxx_compiler(cmake_args: Sequence[str] = ()) -> str | None:
    """The C++ compiler CMake will use: -DCMAKE_CXX_COMPILER= among cmake_args, else $CXX, else c++ on PATH."""
    for arg in cmake_args:
        if m := re.fullmatch(r"-DCMAKE_CXX_COMPILER(:\w+)?=(.+)", arg):
            return m.group(2)
    cxx = os.environ.get("CXX") or "c++"
    found = shutil.which(shlex.split(cxx)[0]) if cxx.strip() else None
    return found or shutil.which("g++")


def shared_runtime_dir(cxx: str) -> Path | None:
    """The directory where cxx's own link finds libstdc++.so (None when it finds none)."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True)
    except OSError:  # no such compiler: CMake will say so
        return None
    path = Path(out.stdout.strip())
    return path.parent if out.returncode == 0 and path.is_absolute() and path.exists() else None


def cuda_host_args(cmake_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """(CMake arguments, linker flags) for a CUDA build: nvcc, and CMake's CUDA link (which runs nvcc's host
    compiler), use the C++ compiler of the rest of the tree; that compiler's libstdc++.so directory goes first
    among the shared links' -L directories (the caller puts the flags first in CMAKE_SHARED_LINKER_FLAGS), so a
    libstdc++.a in a CUDA or wheel directory cannot win `-lstdc++`."""
    cxx = cxx_compiler(cmake_args)
    if cxx is None:
        return [], ""
    runtime = shared_runtime_dir(cxx)
    return [f"-DCMAKE_CUDA_HOST_COMPILER={cxx}"], f"-L{runtime}" if runtime is not None else ""


# set to "warn" to log the check's problems instead of failing the build
WARN_ONLY = "EDGEMOE_CXX_RUNTIME_CHECK"


class CxxRuntimeError(RuntimeError):
    """A built library carries its own C++ runtime; the message lists each problem and what to do."""


def check_build(lib_dir: Path, *, logfile: Path | None = None, cuda_build_dir: Path | None = None) -> str:
    """The check over lib_dir's libraries after a build; with cuda_build_dir, cuda_link_report goes into
    logfile first. Returns a summary; raises CxxRuntimeError (a warning instead with EDGEMOE_CXX_RUNTIME_CHECK=warn)."""
    report = cuda_link_report(cuda_build_dir) if cuda_build_dir is not None else ""
    if report and logfile is not None:
        with logfile.open("a") as f:
            f.write("\n" + report + "\n")
    problems = library_problems(lib_dir)
    if problems:
        where = f" (the CUDA link's C++ runtime is in {logfile})" if report and logfile is not None else ""
        message = f"the C++ runtime check failed on {lib_dir}{where}:\n" + "\n".join(problems)
        if os.environ.get(WARN_ONLY) == "warn":  # a lent GPU's one session: go on, the loader's guard preloads
            return f"WARNING ({WARN_ONLY}=warn): {message}"
        raise CxxRuntimeError(f"{message}\n(set {WARN_ONLY}=warn to go on with these libraries; the loader "
                              "then loads libstdc++.so.6 globally before them)")
    names = ", ".join(p.name for p in elf().library_files(lib_dir))
    return f"C++ runtime check: {names} take the C++ runtime from libstdc++.so.6"


def _ninja() -> str | None:
    return shutil.which("ninja") or next(
        (str(p) for p in (Path(sys.executable).parent / "ninja",) if p.exists()), None
    )


def cuda_link_line(build_dir: Path) -> str | None:
    """The command that links libggml-cuda in a configured build directory (Ninja or Makefiles)."""
    if (build_dir / "build.ninja").exists() and (ninja := _ninja()):
        out = subprocess.run([ninja, "-C", str(build_dir), "-t", "commands", "ggml-cuda"],
                             capture_output=True, text=True).stdout
        lines = [ln for ln in out.splitlines() if re.search(r"-o \S*libggml-cuda\.so", ln)]
        return lines[-1] if lines else None
    link = next(iter(build_dir.glob("**/ggml-cuda.dir/link.txt")), None)
    return link.read_text().strip() if link else None


def _runtime_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("libstdc++.*") if re.fullmatch(r"libstdc\+\+\.(a|so[.0-9]*)", p.name))


def _short(link: str) -> str:
    """The link line with its object files counted, not listed."""
    words = link.split()
    objects = [w for w in words if w.endswith(".o")]
    rest = [w for w in words if not w.endswith(".o")]
    return " ".join(rest) + (f"  [{len(objects)} object files]" if objects else "")


def cuda_link_report(build_dir: Path) -> str:
    """What decides where the CUDA link takes libstdc++ from: nvcc's host compiler and implicit link
    directories (CMakeCUDACompiler.cmake), the ggml-cuda link line, and which of its -L directories, in ld's
    search order, hold libstdc++.a or libstdc++.so. For -lstdc++ ld takes the first directory that holds
    either (the .so when it holds both)."""
    lines = [f"C++ runtime of the CUDA link ({build_dir}):"]
    for cmake in sorted(build_dir.glob("CMakeFiles/*/CMakeCUDACompiler.cmake")):
        for ln in cmake.read_text().splitlines():
            if re.match(r"set\(CMAKE_CUDA_(HOST_COMPILER|HOST_LINK_LAUNCHER|COMPILER_VERSION|IMPLICIT_LINK_"
                        r"(LIBRARIES|DIRECTORIES)|HOST_IMPLICIT_LINK_DIRECTORIES) ", ln):
                lines.append("  " + ln)
    cache = build_dir / "CMakeCache.txt"
    if cache.exists():
        lines += ["  " + ln for ln in cache.read_text().splitlines() if ln.startswith("CMAKE_CXX_COMPILER:")]
    link = cuda_link_line(build_dir)
    lines.append(f"  ggml-cuda link: {_short(link) if link else '(not found)'}")
    if link and "-static-libstdc++" in link:
        lines.append("  the link passes -static-libstdc++ (the defect)")
    if not link:
        return "\n".join(lines)
    words = shlex.split(link.replace("&& :", "").lstrip(": &"))
    launcher = next((w for w in words if not w.startswith("-")), "")
    dirs = [Path(w[2:]) for w in words if w.startswith("-L")]
    # then the launcher's own directories (g++ passes them after the command's -L)
    search = (subprocess.run([launcher, "-print-search-dirs"], capture_output=True, text=True).stdout
              if shutil.which(launcher) else "")
    own = next((ln.split("=", 1)[1] for ln in search.splitlines() if ln.startswith("libraries:")), "")
    dirs += [Path(os.path.normpath(d)) for d in own.split(":") if d]
    winner: tuple[Path, bool] | None = None
    for d in dict.fromkeys(dirs):
        found = _runtime_files(d)
        if found:
            lines.append(f"  -L {d}: {', '.join(found)}")
        if winner is None and ("libstdc++.so" in found or "libstdc++.a" in found):
            winner = (d, "libstdc++.so" in found)
    if winner is not None:
        kind = "shared" if winner[1] else "STATIC: libstdc++.a is linked in (the defect)"
        lines.append(f"  ld takes -lstdc++ from {winner[0]}: {kind}")
    return "\n".join(lines)
