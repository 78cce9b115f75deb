#!/usr/bin/env python3
"""Edit the llama.cpp patch series as git commits, then regenerate patches/.

  python tools/patches.py init     # .build/patchwork/llama.cpp: pristine tree + one commit per patch
  (edit, `git commit` or `git commit --amend` / `git rebase -i` there)
  python tools/patches.py export   # rewrite patches/NNNN-*.patch and patches/series from the commits

Commit subjects become file names, so write them as "area: summary"
(e.g. "moe: add llama_moe_set_hook"). Never edit hunks by hand.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_llama import ROOT, SDIST_NAME, BuildError, fetch_sdist, read_series, unpack  # noqa: E402

WORK = ROOT / ".build" / "patchwork"
BASE_TAG = "edgemoe-base"
GIT_ID = ["-c", "user.name=edgemoe", "-c", "user.email=edgemoe@localhost"]


def git(repo: Path, *args: str, capture: bool = False) -> str:
    proc = subprocess.run(["git", *GIT_ID, *args], cwd=repo, text=True,
                          capture_output=capture)
    if proc.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {repo}"
                         + (f":\n{proc.stderr}" if capture else ""))
    return proc.stdout if capture else ""


def init() -> Path:
    tarball = fetch_sdist(ROOT / ".build" / "sdist", sys.executable)
    src = unpack(tarball, WORK)
    repo = src / "vendor" / "llama.cpp"
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "pristine llama.cpp from llama-cpp-python sdist")
    git(repo, "tag", BASE_TAG)
    for p in read_series(ROOT / "patches"):
        proc = subprocess.run(["git", *GIT_ID, "am", "-q", "--keep-cr", str(p)], cwd=repo)
        if proc.returncode != 0:
            raise BuildError(f"{p.name} did not apply; resolve it in {repo} (git am --show-current-patch), "
                             "then `git am --continue` and export")
    print(f"patch work tree ready: {repo}")
    return repo


def export() -> None:
    repo = WORK / SDIST_NAME / "vendor" / "llama.cpp"
    if not (repo / ".git").exists():
        raise BuildError(f"no work tree at {repo}; run `python tools/patches.py init` first")
    out = ROOT / "patches"
    for old in out.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    names = git(repo, "format-patch", "--zero-commit", "--no-signature", "--no-stat", "--no-numbered",
                "--full-index", "-o", str(out), f"{BASE_TAG}..HEAD", capture=True).split()
    series = [Path(n).name for n in names]
    header = "# applied in order by tools/build_llama.py; regenerate with tools/patches.py export\n"
    (out / "series").write_text(header + "".join(f"{n}\n" for n in series))
    print(f"wrote {len(series)} patches to {out}")



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["init", "export"])
    args = ap.parse_args(argv)
    try:
        if args.action == "init":
            if WORK.exists():
                shutil.rmtree(WORK)
            init()
        else:
            export()
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
