"""The C++ runtime check (edgemoe/runtime/native/elf.py), where the builds run it, and the loader's guard.

The device's defect, rebuilt here with g++: a shared library with a static libstdc++ linked in and exported
(no libstdc++.so.6 among its NEEDED entries, thousands of exported std:: symbols)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgemoe.runtime.native import elf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_llama as bl  # noqa: E402
import build_native_tree as bnt  # noqa: E402
import cxx_runtime  # noqa: E402

CXX_SOURCE = """
#include <iostream>
#include <sstream>
#include <string>
extern "C" int lib_print(long v) {
    std::ostringstream os;
    os << "v=" << v << std::string("!");
    std::cout << os.str() << std::endl;
    return (int)os.str().size();
}
"""
C_SOURCE = "int lib_add(int a, int b) { return a + b; }\n"
SYSTEM_RUNTIME_A = Path(subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True,
                                       text=True).stdout.strip())


def installed_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def link(out: Path, source: Path, *flags: str) -> Path:
    compiler = "gcc" if source.suffix == ".c" else "g++"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", str(out), str(source)], check=True)
    return out


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bad: -static-libstdc++; via_l: plain g++ with a -L directory holding only libstdc++.a first; good: plain
    g++; c: a C library (no C++ code, no libstdc++)."""
    d = tmp_path_factory.mktemp("cxx")
    (d / "lib.cpp").write_text(CXX_SOURCE)
    (d / "lib.c").write_text(C_SOURCE)
    static_only = d / "static-only"
    static_only.mkdir()
    shutil.copy(SYSTEM_RUNTIME_A, static_only / "libstdc++.a")
    return {
        "bad": link(d / "libbad.so", d / "lib.cpp", "-static-libstdc++"),
        "via_l": link(d / "libviaL.so", d / "lib.cpp", f"-L{static_only}"),
        "good": link(d / "libgood.so", d / "lib.cpp"),
        "c": link(d / "libc_only.so", d / "lib.c"),
        "static_only": static_only,
    }


def readelf_needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    return [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]


def nm_defined(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {ln.split()[-1].split("@")[0] for ln in out.stdout.splitlines() if ln.strip()}


def test_reader_agrees_with_binutils(libs: dict[str, Path]) -> None:
    for path in [libs["bad"], libs["good"], *elf.library_files(installed_lib_dir())]:
        table = elf.read_dynamic(path)
        assert list(table.needed) == readelf_needed(path), path
        assert {s.name for s in table.symbols if s.defined} == nm_defined(path), path


def test_static_runtime_fails_the_check(libs: dict[str, Path]) -> None:
    """The device's defect: libstdc++ linked in and exported, libstdc++.so.6 not NEEDED."""
    table = elf.read_dynamic(libs["bad"])
    assert "libstdc++.so.6" not in readelf_needed(libs["bad"]) and "libgcc_s.so.1" in table.needed
    assert {"_ZNSt6locale7classicEv", "__cxa_throw", "_ZNSo9_M_insertIlEERSoT_"} <= nm_defined(libs["bad"])
    problems = elf.cxx_runtime_problems(table)
    assert len(problems) == 3, problems
    assert "libbad.so defines and exports the C++ runtime itself" in problems[0]
    assert "libbad.so has C++ code but does not link libstdc++.so.6" in problems[1]
    assert "-static-libstdc++" in problems[2] and "-L directory" in problems[2] and "docs/build.md" in problems[2]
    assert elf.exported_runtime(libs["bad"]) == elf.runtime_definitions(table) != ()


def test_libstdcxx_a_first_on_the_search_path_gives_the_same_defect(libs: dict[str, Path]) -> None:
    """No -static-libstdc++: a -L directory that holds libstdc++.a but no libstdc++.so, searched before the
    compiler's own, is enough (ld takes the first directory holding either)."""
    table = elf.read_dynamic(libs["via_l"])
    assert "libstdc++.so.6" not in table.needed
    assert elf.runtime_definitions(table)
    # the build's fix: the compiler's own libstdc++.so directory first
    defines, link_flags = cxx_runtime.cuda_host_args()
    assert link_flags.startswith("-L") and (Path(link_flags[2:]) / "libstdc++.so").exists()
    fixed = link(libs["via_l"].with_name("libfixed.so"), libs["via_l"].with_name("lib.cpp"), link_flags,
                 f"-L{libs['static_only']}")
    assert elf.check_libraries([fixed]) == []


def test_normal_and_c_libraries_pass(libs: dict[str, Path]) -> None:
    good = elf.read_dynamic(libs["good"])
    assert elf.has_cxx_code(good) and "libstdc++.so.6" in good.needed
    assert elf.check_libraries([libs["good"], libs["c"]]) == []
    assert not elf.has_cxx_code(elf.read_dynamic(libs["c"]))


def test_installed_libraries_pass_while_exporting_std_instantiations() -> None:
    """libllama exports about a thousand std:: template instantiations: legitimate, not the runtime."""
    files = elf.library_files(installed_lib_dir())
    names = [p.name for p in files]
    assert "libllama.so.0" in names and "libggml-base.so.0" in names
    assert elf.check_libraries(files) == []
    llama = elf.read_dynamic(installed_lib_dir() / "libllama.so.0")
    assert sum(1 for s in llama.symbols if s.exported and s.name.startswith("_ZNSt")) > 300
    assert all(elf.has_cxx_code(elf.read_dynamic(p)) for p in files)


def test_library_files_keeps_one_file_per_library(tmp_path: Path, libs: dict[str, Path]) -> None:
    for name in ("libggml.so", "libggml.so.0", "libggml.so.0.25.3"):
        shutil.copy(libs["good"], tmp_path / name)
    (tmp_path / "libllama.so.0").symlink_to(libs["good"])
    (tmp_path / "README").write_text("")
    assert [p.name for p in elf.library_files(tmp_path)] == ["libggml.so.0", "libllama.so.0"]
    (tmp_path / "libbroken.so").write_text("not ELF")
    assert any("libbroken.so could not be read" in p for p in elf.check_libraries(elf.library_files(tmp_path)))


# -- where the builds run it ------------------------------------------------------------------------------
def fake_build_dir(tmp: Path, lib: Path) -> Path:
    (tmp / "bin").mkdir(parents=True)
    shutil.copy(lib, tmp / "bin" / "libggml-cuda.so.0")
    return tmp


def test_cuda_check_build_runs_the_check(tmp_path: Path, libs: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`make cuda-check`'s run_build, with the compiler replaced: the bad library fails the build, with the
    link's report in the build log."""
    monkeypatch.setattr(bnt, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(bnt, "patched_source", lambda variant: tmp_path / "src")
    build_dir = tmp_path / "cmake-cuda-check"
    fake_build_dir(build_dir, libs["bad"])
    # cmake configure and build succeed at once
    monkeypatch.setattr(bnt, "subprocess", SimpleNamespace(
        run=lambda *a, **k: subprocess.CompletedProcess(a, 0), STDOUT=subprocess.STDOUT))
    with pytest.raises(bl.BuildError, match=r"(?s)C\+\+ runtime check failed.*libggml-cuda\.so\.0 defines"):
        bnt.run_build("cuda-check", [], 1)
    assert "C++ runtime of the CUDA link" in (tmp_path / "build-cuda-check.log").read_text()
    monkeypatch.setenv("EDGEMOE_CXX_RUNTIME_CHECK", "warn")  # goes on, says why
    assert "WARNING" in cxx_runtime.check_build(build_dir / "bin")
    monkeypatch.delenv("EDGEMOE_CXX_RUNTIME_CHECK")
    shutil.copy(libs["good"], build_dir / "bin" / "libggml-cuda.so.0")
    assert bnt.run_build("cuda-check", [], 1)["libs"] == ["libggml-cuda.so.0"]


def test_pip_build_checks_the_installed_libraries(tmp_path: Path, libs: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/build_llama.py's check finds llama_cpp/lib through the venv's Python (here: a fake package first on
    PYTHONPATH) and fails the build on a bad library."""
    lib_dir = tmp_path / "site" / "llama_cpp" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir.parent / "__init__.py").write_text("raise SystemExit('the check must not import llama_cpp')\n")
    shutil.copy(libs["bad"], lib_dir / "libggml-cuda.so")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    cpu = bl.BuildOptions(cuda=False, cuda_arch="", native=True, extra_cmake="")
    found = bl.installed_lib_dir(sys.executable)
    assert found == lib_dir
    with pytest.raises(bl.BuildError, match=r"(?s)libggml-cuda\.so defines and exports.*--force"):
        bl.check_cxx_runtime(found, cpu, None)
    shutil.copy(libs["good"], lib_dir / "libggml-cuda.so")
    bl.check_cxx_runtime(found, cpu, None)


def test_cuda_builds_pin_the_host_compiler_and_the_shared_runtime() -> None:
    args = bl.BuildOptions(cuda=True, cuda_arch="90", native=False, extra_cmake="").cmake_args()
    host = [a for a in args if a.startswith("-DCMAKE_CUDA_HOST_COMPILER=")]
    assert len(host) == 1 and Path(host[0].split("=", 1)[1]).exists()
    flags = [a for a in args if a.startswith("-DCMAKE_SHARED_LINKER_FLAGS=-L")]
    assert len(flags) == 1 and (Path(flags[0].split("=-L", 1)[1]) / "libstdc++.so").exists()
    pinned = bl.BuildOptions(cuda=True, cuda_arch="", native=False, extra_cmake="-DCMAKE_CXX_COMPILER=/opt/g++")
    assert "-DCMAKE_CUDA_HOST_COMPILER=/opt/g++" in pinned.cmake_args()
    assert not any("CUDA_HOST" in a for a in bl.BuildOptions(False, "", True, "").cmake_args())


def test_cuda_link_report_names_the_directory_ld_takes_libstdcxx_from(tmp_path: Path,
                                                                      libs: dict[str, Path]) -> None:
    """The diagnostic a GPU build writes into its log, on a configured tree (Makefiles layout) whose link
    searches a libstdc++.a-only directory first."""
    (tmp_path / "CMakeFiles" / "3.31.0").mkdir(parents=True)
    (tmp_path / "CMakeFiles" / "3.31.0" / "CMakeCUDACompiler.cmake").write_text(
        'set(CMAKE_CUDA_HOST_LINK_LAUNCHER "/usr/bin/g++")\nset(CMAKE_CUDA_IMPLICIT_LINK_LIBRARIES "stdc++;m")\n')
    link_txt = tmp_path / "ggml" / "src" / "ggml-cuda" / "CMakeFiles" / "ggml-cuda.dir" / "link.txt"
    link_txt.parent.mkdir(parents=True)
    link_txt.write_text(f"/usr/bin/g++ -fPIC -shared -o bin/libggml-cuda.so.0 a.cu.o b.cu.o -lcudart_static "
                        f'-L"{libs["static_only"]}"\n')
    report = cxx_runtime.cuda_link_report(tmp_path)
    assert 'CMAKE_CUDA_HOST_LINK_LAUNCHER "/usr/bin/g++"' in report and "[2 object files]" in report
    assert f"ld takes -lstdc++ from {libs['static_only']}: STATIC" in report
    link_txt.write_text("/usr/bin/g++ -fPIC -shared -o bin/libggml-cuda.so.0 a.cu.o\n")
    assert "ld takes -lstdc++ from" in (shared := cxx_runtime.cuda_link_report(tmp_path))
    assert shared.rstrip().endswith(": shared")


# -- the loader's guard -----------------------------------------------------------------------------------
GUARD_CHILD = """
import ctypes, json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "ctypes.dlopen" else None)
from edgemoe.runtime.native import loader
g = loader.cxx_runtime_guard
# what crashed on the GPU: a library carrying its own runtime in the global scope; which copy does a lookup get?
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]
addr = ctypes.cast(getattr(ctypes.CDLL(None), "_ZNSt6locale7classicEv"), ctypes.c_void_p).value
info = DlInfo()
ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info))
print(json.dumps({"offenders": list(g.offenders), "preloaded": g.preloaded, "too_late": g.too_late,
                  "opened": opened, "locale_from": info.fname.decode()}))
"""


def run_guard_child(lib_dir: Path, bad: Path) -> dict:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", GUARD_CHILD, str(bad)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lib_dir_copy(tmp: Path, extra: Path | None) -> Path:
    """The installed libraries (symlinked), and extra beside them."""
    tmp.mkdir()
    for p in installed_lib_dir().glob("lib*.so*"):
        (tmp / p.name).symlink_to(p)
    if extra is not None:
        shutil.copy(extra, tmp / "libggml-cuda.so.0")
    return tmp


def test_guard_preloads_the_system_runtime_before_libllama(tmp_path: Path, libs: dict[str, Path]) -> None:
    out = run_guard_child(lib_dir_copy(tmp_path / "lib", libs["bad"]), libs["bad"])
    assert out["offenders"] == ["libggml-cuda.so.0"] and not out["too_late"]
    assert Path(out["preloaded"]).name.startswith("libstdc++.so.6")
    opened = out["opened"]
    llama = next(i for i, name in enumerate(opened) if name.endswith("libllama.so"))
    assert opened.index("libstdc++.so.6") < llama, opened
    # the global scope resolves std:: to the system runtime, not to the copy loaded globally after it
    assert Path(out["locale_from"]).name.startswith("libstdc++.so.6"), out


def test_guard_does_nothing_on_clean_libraries(tmp_path: Path, libs: dict[str, Path]) -> None:
    out = run_guard_child(lib_dir_copy(tmp_path / "lib", None), libs["bad"])
    assert out["offenders"] == [] and out["preloaded"] is None
    assert "libstdc++.so.6" not in out["opened"]
    # without the guard, the copy a library exports globally is what a lookup gets (the device's crash)
    assert Path(out["locale_from"]).name == libs["bad"].name, out


def test_guard_record_of_this_process() -> None:
    from edgemoe.runtime.native import loader

    assert loader.guard_cxx_runtime(None) == loader.CxxRuntimeGuard(None, (), None, True)
    guard = loader.cxx_runtime_guard
    assert guard.lib_dir == installed_lib_dir() and guard.offenders == () and guard.preloaded is None
