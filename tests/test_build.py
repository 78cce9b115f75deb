"""The patch pipeline: the series applies to the pinned sdist, failures name the patch, the stamp tracks inputs."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_llama as bl  # noqa: E402
import llama_git  # noqa: E402

SDIST = ROOT / ".build" / "sdist" / f"{bl.SDIST_NAME}.tar.gz"
needs_sdist = pytest.mark.skipif(not SDIST.exists(), reason="sdist not downloaded (make install fetches it)")


def test_series_lists_existing_numbered_patches() -> None:
    patches = bl.read_series(ROOT / "patches")
    assert patches, "the series is empty"
    for i, p in enumerate(patches, start=1):
        assert p.name.startswith(f"{i:04d}-") and p.suffix == ".patch"


@needs_sdist
def test_series_applies_to_pristine_sdist(tmp_path: Path) -> None:
    src = bl.unpack(SDIST, tmp_path / "src")
    bl.apply_series(src, bl.read_series(ROOT / "patches"))
    llama_dir = src / "vendor" / "llama.cpp"
    header = (llama_dir / "include" / "llama.h").read_text()
    assert "llama_edgemoe_patch_level" in header
    # one commit per patch on the sdist's source, each stamped
    patches = bl.read_series(ROOT / "patches")
    n = llama_git.git(llama_dir, "rev-list", "--count", f"{llama_git.BASE_TAG}..HEAD").stdout.strip()
    assert int(n) == len(patches)
    assert llama_git.applied(llama_dir) == sorted(p.name for p in patches)


@needs_sdist
def test_moved_context_merges_three_way(tmp_path: Path) -> None:
    """A base whose lines around a hunk changed: plain `git apply` refuses, `git am -3` merges."""
    llama_dir = bl.unpack(SDIST, tmp_path / "src") / "vendor" / "llama.cpp"
    llama_git.init_base(llama_dir, "test")
    header = llama_dir / "include" / "llama.h"
    text = header.read_text()
    anchor = "    LLAMA_API bool llama_supports_gpu_offload(void);\n"  # the hunk's first context line
    assert anchor in text
    header.write_text(text.replace(anchor, anchor.rstrip() + " // a comment upstream added\n"))
    llama_git.git(llama_dir, "commit", "-q", "-am", "upstream moved the context")
    first = bl.read_series(ROOT / "patches")[0]
    assert llama_git.git(llama_dir, "apply", "--check", str(first), check=False).returncode != 0
    llama_git.am_series(llama_dir, [first], fix_hint="", log=lambda _: None)
    merged = header.read_text()
    assert "llama_edgemoe_patch_level" in merged and "a comment upstream added" in merged


@needs_sdist
def test_broken_patch_names_itself_and_how_to_refresh(tmp_path: Path) -> None:
    src = bl.unpack(SDIST, tmp_path / "src")
    bad = tmp_path / "0099-moe-broken.patch"
    good = bl.read_series(ROOT / "patches")[0].read_text()
    bad.write_text(good.replace("@@ -569,6 +569,10 @@", "@@ -9569,6 +9569,10 @@").replace(
        "LLAMA_API bool llama_supports_rpc", "LLAMA_API bool llama_supports_nothing"))
    with pytest.raises(bl.BuildError, match=r"(?s)0099-moe-broken\.patch does not apply.*"
                                            r"git am --continue.*git am --skip.*git am --abort.*tools/patches\.py"):
        bl.apply_series(src, [bad])


def test_stamp_changes_with_patches_and_options(tmp_path: Path) -> None:
    p = tmp_path / "0001-a.patch"
    p.write_text("one")
    cpu = bl.BuildOptions(cuda=False, cuda_arch="", native=True, extra_cmake="")
    cuda = bl.BuildOptions(cuda=True, cuda_arch="90", native=True, extra_cmake="")
    k1 = bl.stamp_key([p], cpu)
    assert bl.stamp_key([p], cpu) == k1
    assert bl.stamp_key([p], cuda) != k1
    p.write_text("two")
    assert bl.stamp_key([p], cpu) != k1


def test_cmake_args() -> None:
    cpu = bl.BuildOptions(cuda=False, cuda_arch="", native=True, extra_cmake="-DFOO=1")
    args = cpu.cmake_args()
    assert "-DLLAVA_BUILD=OFF" in args and "-DLLAMA_BUILD_SERVER=OFF" in args and "-DFOO=1" in args
    assert not any("GGML_CUDA" in a for a in args)
    cuda = bl.BuildOptions(cuda=True, cuda_arch="86;89", native=False, extra_cmake="")
    assert "-DGGML_CUDA=ON" in cuda.cmake_args() and "-DCMAKE_CUDA_ARCHITECTURES=86;89" in cuda.cmake_args()


def test_missing_series_entry(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("0001-missing.patch\n")
    with pytest.raises(bl.BuildError, match="0001-missing.patch"):
        bl.read_series(tmp_path)


def test_each_patch_has_the_project_as_author_and_a_body_naming_its_test() -> None:
    for p in bl.read_series(ROOT / "patches"):
        header = p.read_text().split("\ndiff --git ", 1)[0]
        assert "\nFrom: edgemoe <edgemoe@users.noreply.github.com>\n" in header, p.name
        body = header.split("\nSubject: ", 1)[1].split("\n", 1)[1]
        assert len(body.split()) > 30 and "tests/test_" in body, f"{p.name}: no body naming its test"


def test_patch_level_is_set_once_to_what_the_python_side_requires() -> None:
    native_src = (ROOT / "edgemoe" / "runtime" / "native" / "loader.py").read_text()
    required = int(re.search(r"^REQUIRED_PATCH_LEVEL = (\d+)$", native_src, re.M).group(1))
    setters = {p.name: re.findall(r"^\+int32_t llama_edgemoe_patch_level\(void\) \{\n\+    return (\d+);",
                                  p.read_text(), re.M)
               for p in bl.read_series(ROOT / "patches")}
    touching = {name: levels for name, levels in setters.items() if levels}
    first = bl.read_series(ROOT / "patches")[0].name
    assert touching == {first: [str(required)]}
    later = [p.name for p in bl.read_series(ROOT / "patches")[1:]
             if re.search(r"^[+-][^+-].*edgemoe_patch_level", p.read_text(), re.M)]
    assert later == []


def changed_lines_per_file(patch: Path, sign: str) -> dict[str, int]:
    """Lines a patch adds (sign "+") or removes ("-") per file."""
    counts: dict[str, int] = {}
    current = ""
    for line in patch.read_text().split("\n"):
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
        elif line.startswith(sign) and not line.startswith(sign * 3):
            counts[current] = counts.get(current, 0) + 1
    return counts


def series_lines_per_file(sign: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in bl.read_series(ROOT / "patches"):
        for name, n in changed_lines_per_file(p, sign).items():
            total[name] = total.get(name, 0) + n
    return total


def test_moe_code_lives_in_its_own_files() -> None:
    """The series keeps upstream's busiest files to call sites: the hook and the cache are classes of their own
    (src/llama-moe-hook.*, src/llama-moe-cache.*) and build_moe_ffn calls steps in src/llama-moe-graph.*, so an
    upgrade meets few hunks in llama-context.cpp and llama-graph.cpp."""
    added, removed = series_lines_per_file("+"), series_lines_per_file("-")
    # what the series leaves in a file: a line one patch adds and a later one replaces counts once
    net = {name: n - removed.get(name, 0) for name, n in added.items()}
    assert net["src/llama-context.cpp"] < 80 and net["src/llama-context.h"] < 30, net
    # build_moe_ffn: a few calls, upstream's expert FFN moved whole into build_moe_experts (its tail moves after it)
    assert added["src/llama-graph.cpp"] < 160 and removed["src/llama-graph.cpp"] < 70, (added, removed)
    assert added["src/llama-graph.h"] < 80, added
    for name in ("src/llama-moe-hook.h", "src/llama-moe-hook.cpp", "src/llama-moe-cache.h", "src/llama-moe-cache.cpp",
                 "src/llama-moe-graph.h", "src/llama-moe-graph.cpp"):
        assert added.get(name, 0) > 50, f"{name} is not written by the series"
    # no llama_context member of the MoE code is defined outside the new files
    context_hunks = "".join(p.read_text() for p in bl.read_series(ROOT / "patches"))
    assert not re.search(r"^\+[^\n]*\bllama_context::(moe_\w+|set_moe_hook)\(", context_hunks, re.M)


def test_native_tree_rebuild_keeps_unchanged_files_mtimes(tmp_path: Path) -> None:
    """tools/build_native_tree.py reuses its build directory: a fresh tree whose file did not change keeps the old
    mtime (ninja skips it), a changed or new file keeps its new one."""
    import os

    import build_native_tree as bnt

    (tmp_path / "a.h").write_text("same")
    (tmp_path / "b.cu").write_text("old")
    os.utime(tmp_path / "a.h", ns=(10**18, 10**18))
    before = bnt.file_stamps(tmp_path)
    # a fresh unpack and patch: every file rewritten now
    (tmp_path / "a.h").write_text("same")
    (tmp_path / "b.cu").write_text("new")
    (tmp_path / "c.cpp").write_text("added")
    assert bnt.keep_unchanged_mtimes(tmp_path, before, bnt.file_stamps(tmp_path)) == 1
    assert (tmp_path / "a.h").stat().st_mtime_ns == 10**18
    assert (tmp_path / "b.cu").stat().st_mtime_ns > 10**18 and (tmp_path / "c.cpp").stat().st_mtime_ns > 10**18
    assert bnt.file_stamps(tmp_path / "missing") == {}


LLAMA_TREE = ROOT / ".build" / "src" / bl.SDIST_NAME / "vendor" / "llama.cpp"


@pytest.mark.long  # builds test-backend-ops: the long suite (`make test-long`)
@pytest.mark.skipif(not (LLAMA_TREE / "tests").exists(), reason="no patched tree under .build/src (make install)")
def test_install_backend_ops_puts_a_working_binary_and_the_headers_in_place(tmp_path: Path) -> None:
    """The install step doctor's op step relies on: test-backend-ops built against the installed libraries, the
    ggml headers beside it, and the series' cases passing on the CPU with it."""
    import subprocess

    from edgemoe.runtime.op_tests import BACKEND_OPS_NAME, NATIVE_TOOLS_DIR, check_output, series_total

    dest = tmp_path / NATIVE_TOOLS_DIR
    exe = bl.install_backend_ops(LLAMA_TREE, bl.installed_lib_dir(sys.executable), dest)
    assert exe == dest / BACKEND_OPS_NAME
    assert (dest / "include" / "ggml.h").read_text() == (LLAMA_TREE / "ggml" / "include" / "ggml.h").read_text()
    proc = subprocess.run([str(exe), "test", "-b", "CPU", "-o", "MUL_MAT_ID_SKIP,ADD_ID_SKIP,MOE_GATE"],
                          capture_output=True, text=True, timeout=300)
    assert check_output("CPU", proc.returncode, proc.stdout) == series_total()


@pytest.mark.skipif(not (LLAMA_TREE / "src").exists(), reason="no patched tree under .build/src (make install)")
def test_the_moe_code_reaches_the_context_through_a_seam_and_is_split_by_concern() -> None:
    """The applied tree: llama_context has no friend among the MoE structs, whose sources name none of its private
    members (they call graph_invalidate(), graph_active(), get_backend() and the getters); the cache is split by
    concern (device prefill and each native policy in a file of its own, behind llama_moe_policy_i), no MoE source
    over 800 lines, the cache's under 1,200."""
    src = LLAMA_TREE / "src"
    assert not re.search(r"\bfriend\s+struct\s+llama_moe_", (src / "llama-context.h").read_text())
    sizes = {}
    for f in sorted(src.glob("llama-moe-*.cpp")):
        text = f.read_text()
        for private in ("gf_res_prev_active", "sched_need_reserve", "backends"):
            assert not re.search(rf"\b{private}\b", text), (f.name, private)
        sizes[f.name] = len(text.splitlines())
    others = {name: n for name, n in sizes.items() if name != "llama-moe-cache.cpp"}
    assert sizes["llama-moe-cache.cpp"] < 1200 and max(others.values()) <= 800, sizes
    for name in ("prefill", "policy", "policy-lru", "policy-window", "policy-swap", "policy-prefetch"):
        assert f"llama-moe-{name}.cpp" in sizes, sorted(sizes)
    policies = "".join((src / f"llama-moe-policy-{n}.cpp").read_text() for n in ("lru", "window", "swap", "prefetch"))
    assert len(re.findall(r"^struct llama_moe_policy_\w+ : llama_moe_policy_(?:i|placed) \{", policies, re.M)) == 4
    # the context calls the cache and the hook; it reads none of their fields
    ctx = (src / "llama-context.cpp").read_text()
    assert not re.search(r"moe_(?:cache|hook)->(?!\w+\()", ctx), re.findall(r"moe_(?:cache|hook)->\w+", ctx)
