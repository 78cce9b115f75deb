#!/usr/bin/env python3
"""Edit the llama.cpp patch series as git commits, regenerate patches/, carry it to a new llama.cpp.

  python tools/patches.py init              # .build/patchwork/llama.cpp: the sdist's source + one commit per patch
  (edit; `git commit`, or `git commit --fixup` + `git rebase -i --autosquash` there)
  python tools/patches.py export            # rewrite patches/NNNN-*.patch and patches/series from the commits
  python tools/patches.py rebase NEW_SDIST  # move the commits onto another llama-cpp-python's llama.cpp
  python tools/patches.py rebase --continue # after resolving a conflict (or --skip, --abort)

Commit subjects become file names, so write them as "area: summary"; the body says why and names
the test. Never edit hunks by hand. docs/upgrading-llama.md walks through an upgrade.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_git  # noqa: E402
from build_llama import ROOT, SDIST_NAME, SDIST_SHA256, BuildError, fetch_sdist, read_series, unpack  # noqa: E402
from llama_git import BASE_TAG, SeriesError, git  # noqa: E402

WORK = ROOT / ".build" / "patchwork"
REPO = WORK / "llama.cpp"
SERIES_BRANCH = "series"
NEW_BASE_TAG = "edgemoe-new-base"  # the tree being rebased onto, while a rebase runs
OLD_BASE_TAG = "edgemoe-old-base"  # the pinned sdist's tree, kept after a rebase
FIX_HINT = ("Resolve it here, `git am --continue`, then `python tools/patches.py export`; "
            "or `git am --skip` to drop the patch from the series.")


def init() -> Path:
    """Fresh REPO: the pinned sdist's vendored llama.cpp as the base commit, then one commit per patch."""
    if WORK.exists():
        shutil.rmtree(WORK)
    tarball = fetch_sdist(ROOT / ".build" / "sdist", sys.executable)
    src = unpack(tarball, WORK / "unpacked")
    (src / "vendor" / "llama.cpp").rename(REPO)
    shutil.rmtree(WORK / "unpacked")
    llama_git.init_base(REPO, f"{SDIST_NAME} (sha256 {SDIST_SHA256[:12]})")
    git(REPO, "checkout", "-q", "-b", SERIES_BRANCH)
    llama_git.am_series(REPO, read_series(ROOT / "patches"), FIX_HINT)
    print(f"patch work tree ready: {REPO}")
    return REPO


def require_repo() -> None:
    if not (REPO / ".git").exists():
        raise SeriesError(f"no patch work tree at {REPO}; run `python tools/patches.py init` first")


def export() -> None:
    require_repo()
    if (REPO / ".git" / "rebase-merge").exists() or (REPO / ".git" / "rebase-apply").exists():
        raise SeriesError("a rebase or `git am` is in progress in the patch work tree; finish it first")
    out = ROOT / "patches"
    for old in out.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    names = git(REPO, "format-patch", "--zero-commit", "--no-signature", "--no-stat", "--no-numbered",
                "--full-index", "-o", str(out), f"{BASE_TAG}..HEAD").stdout.split()
    series = [Path(n).name for n in names]
    header = "# applied in order by tools/build_llama.py; regenerate with tools/patches.py export\n"
    (out / "series").write_text(header + "".join(f"{n}\n" for n in series))
    print(f"wrote {len(series)} patches to {out}")


def sdist_version(tarball: Path) -> str:
    m = re.match(r"llama_cpp_python-(.+)\.tar\.gz$", tarball.name)
    if not m:
        raise SeriesError(f"{tarball.name} is not a llama-cpp-python sdist (llama_cpp_python-X.Y.Z.tar.gz); "
                          "get one with `pip download --no-deps --no-binary :all: llama-cpp-python==X.Y.Z`")
    return m.group(1)


def commit_new_base(tarball: Path) -> str:
    """Commit the new sdist's vendored llama.cpp as a child of the base commit (git log -p shows upstream's changes); tag it NEW_BASE_TAG."""
    version = sdist_version(tarball)
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        unpack(tarball, Path(tmp) / "src")
        src = Path(tmp) / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        if not src.is_dir():
            raise SeriesError(f"{tarball} has no vendor/llama.cpp")
        git(REPO, "checkout", "-q", "--detach", BASE_TAG)
        git(REPO, "rm", "-r", "-q", "--cached", ".")
        for child in REPO.iterdir():
            if child.name != ".git":
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        for child in src.iterdir():
            if child.name == ".git":  # the sdist's submodule link
                continue
            shutil.move(str(child), REPO / child.name)
    commit = llama_git.commit_all(REPO, f"llama.cpp vendored in llama_cpp_python-{version}")
    git(REPO, "tag", "-f", NEW_BASE_TAG, commit)
    return version


def conflict_help() -> str:
    files = git(REPO, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    stopped = git(REPO, "log", "-1", "--format=%s", "REBASE_HEAD", check=False).stdout.strip()
    listed = "\n".join(f"    {f}" for f in files) or "    (none marked)"
    return (f"the rebase stopped at \"{stopped}\" in {REPO}; files with conflicts:\n{listed}\n"
            "What to do: resolve them there (`git diff` shows both sides; `git diff "
            f"{BASE_TAG} {NEW_BASE_TAG} -- FILE` shows what upstream changed), `git add` them, then\n"
            "  python tools/patches.py rebase --continue\n"
            "or  python tools/patches.py rebase --skip   (drop this patch)\n"
            "or  python tools/patches.py rebase --abort  (back to the series on the pinned sdist)")


def rebase_step(args: list[str]) -> None:
    proc = git(REPO, "-c", "core.editor=true", "rebase", *args, check=False)
    if proc.returncode != 0:
        if not (REPO / ".git" / "rebase-merge").exists():
            raise SeriesError(f"git rebase {' '.join(args)} failed:\n{(proc.stderr or proc.stdout).strip()}")
        raise SeriesError(conflict_help())
    finish_rebase()


def finish_rebase() -> None:
    git(REPO, "tag", "-f", OLD_BASE_TAG, BASE_TAG)
    git(REPO, "tag", "-f", BASE_TAG, NEW_BASE_TAG)
    n = len(git(REPO, "rev-list", f"{BASE_TAG}..{SERIES_BRANCH}").stdout.split())
    print(f"the series ({n} commits) now sits on {git(REPO, 'log', '-1', '--format=%s', BASE_TAG).stdout.strip()}.\n"
          "Next: pin that sdist in tools/build_llama.py (SDIST_NAME, SDIST_VERSION, SDIST_SHA256), run "
          "`python tools/patches.py export`, `make install`, and the checks in docs/upgrading-llama.md.")


def rebase(tarball: Path) -> None:
    """Rebase the series (BASE_TAG..SERIES_BRANCH) onto the new sdist's tree with 3-way merges."""
    if not (REPO / ".git").exists():
        init()
    if (REPO / ".git" / "rebase-merge").exists():
        raise SeriesError("a rebase is already in progress; use --continue, --skip or --abort")
    if git(REPO, "status", "--porcelain").stdout.strip():
        raise SeriesError(f"{REPO} has uncommitted changes; commit or discard them first")
    version = commit_new_base(tarball.resolve())
    print(f"rebasing the series onto llama.cpp from llama-cpp-python {version}")
    rebase_step(["--onto", NEW_BASE_TAG, BASE_TAG, SERIES_BRANCH])


def rebase_control(action: str) -> None:
    require_repo()
    if not (REPO / ".git" / "rebase-merge").exists():
        raise SeriesError("no rebase in progress")
    if action == "abort":
        git(REPO, "rebase", "--abort")
        git(REPO, "tag", "-d", NEW_BASE_TAG)
        print(f"rebase aborted; {REPO} holds the series on the pinned sdist again")
        return
    if action == "continue":
        unresolved = git(REPO, "diff", "--name-only", "--diff-filter=U").stdout.split()
        if unresolved:
            raise SeriesError("still unresolved: " + ", ".join(unresolved) + "; edit and `git add` them first")
    rebase_step([f"--{action}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("init", help="fresh patch work tree: base commit + one commit per patch")
    sub.add_parser("export", help="rewrite patches/ from the work tree's commits")
    rb = sub.add_parser("rebase", help="carry the series onto another llama-cpp-python sdist")
    rb.add_argument("sdist", nargs="?", type=Path, help="llama_cpp_python-X.Y.Z.tar.gz")
    group = rb.add_mutually_exclusive_group()
    for flag in ("continue", "skip", "abort"):
        group.add_argument(f"--{flag}", action="store_true", help=f"{flag} a rebase that stopped")
    args = ap.parse_args(argv)
    try:
        if args.action == "init":
            init()
        elif args.action == "export":
            export()
        else:
            control = next((f for f in ("continue", "skip", "abort") if getattr(args, f)), None)
            if control:
                rebase_control(control)
            elif args.sdist is None:
                ap.error("rebase needs NEW_SDIST, or --continue/--skip/--abort")
            else:
                rebase(args.sdist)
    except (BuildError, SeriesError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
