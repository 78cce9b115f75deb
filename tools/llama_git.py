"""The vendored llama.cpp as a git repository: a base commit of the sdist's source, the series on top.

Used by tools/build_llama.py (apply the series with ``git am -3``) and tools/patches.py (edit, export,
rebase it). A 3-way merge needs the file a patch was made against: the base commit provides it, and
``format-patch --full-index`` writes its blob id into every patch.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

BASE_TAG = "edgemoe-base"
AUTHOR_NAME = "edgemoe"
AUTHOR_EMAIL = "edgemoe@users.noreply.github.com"
# a fixed date makes the base commit's id depend on the source only
BASE_DATE = "2000-01-01T00:00:00+0000"
STAMP_DIR = "edgemoe-applied"  # under .git: one file per applied patch (its sha256 and commit)


class SeriesError(RuntimeError):
    """A git step on the vendored tree failed; the message says what to do."""


def git(repo: Path, *args: str, check: bool = True, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run git in ``repo`` as the project, never walking up into an enclosing checkout."""
    full_env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(repo.parent), **(env or {}))
    proc = subprocess.run(["git", "-c", f"user.name={AUTHOR_NAME}", "-c", f"user.email={AUTHOR_EMAIL}",
                           "-c", "core.autocrlf=false", *args], cwd=repo, text=True, capture_output=True,
                          env=full_env, input=stdin)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {repo}:\n{(proc.stderr or proc.stdout).strip()}")
    return proc


def commit_all(repo: Path, message: str) -> str:
    """Commit every file of the tree (ignored ones too: the tree is the sdist's, whole) at BASE_DATE."""
    git(repo, "add", "-A", "-f", ".")
    git(repo, "commit", "-q", "--allow-empty", "-m", message,
        env={"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE})
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def init_base(tree: Path, source: str) -> str:
    """Make ``tree`` a repository whose first commit is its current contents, tagged BASE_TAG."""
    link = tree / ".git"
    if link.is_file():  # the sdist's submodule link to a repository it does not ship
        link.unlink()
    if link.exists():
        raise SeriesError(f"{tree} is already a git repository; start from a freshly unpacked tree")
    git(tree, "init", "-q")
    commit = commit_all(tree, f"llama.cpp vendored in {source}")
    git(tree, "tag", "-f", BASE_TAG)
    return commit


def am_failure(tree: Path, patch: Path, output: str, fix_hint: str) -> str:
    conflicted = git(tree, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    files = "\n".join(f"    {f}" for f in conflicted) or "    (none marked: see git am's output above)"
    return (f"patch {patch.name} does not apply to the vendored llama.cpp, not even with a 3-way merge:\n"
            f"{output.strip()}\n"
            f"The tree {tree} is left in the middle of `git am`; files with conflicts:\n{files}\n"
            "What to do, in that directory:\n"
            "  resolve: edit those files, `git add` them, then `git am --continue` (the next patches follow)\n"
            "  skip:    `git am --skip` drops this patch (its feature is missing; edgemoe checks the level)\n"
            "  abort:   `git am --abort` returns to the last patch that applied\n"
            f"{fix_hint}")


def stamp_path(tree: Path, patch: Path) -> Path:
    return tree / ".git" / STAMP_DIR / patch.name


def am_series(tree: Path, patches: list[Path], fix_hint: str, log=print) -> None:
    """Apply ``patches`` in order with ``git am -3``, stamping each; stop at the first that fails."""
    for p in patches:
        proc = git(tree, "am", "-3", "-q", "--keep-cr", "--committer-date-is-author-date", str(p.resolve()),
                   check=False)
        if proc.returncode != 0:
            raise SeriesError(am_failure(tree, p, proc.stdout + proc.stderr, fix_hint))
        commit = git(tree, "rev-parse", "HEAD").stdout.strip()
        stamp = stamp_path(tree, p)
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(f"{hashlib.sha256(p.read_bytes()).hexdigest()} {commit}\n")
        log(f"applied {p.name}")


def applied(tree: Path) -> list[str]:
    """The names of the patches stamped as applied in ``tree``, in file-name order."""
    d = tree / ".git" / STAMP_DIR
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
