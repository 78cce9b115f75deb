"""The docs name patches by feature, not by number: numbers change when the series is regrouped (the 26-patch
series became 13 on 2026-11-25 and left 44 stale references). patches/README.md, which defines the numbers, is
the one place that may use them. Likewise code and docs name features, never the issue tracker's numbers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# "patch 0013", "patches 0016, 0024", "(0008)", "0005/0006", "since 0024": a four-digit number of the series' form
PATCH_NUMBER = re.compile(r"\bpatch(?:es)? 00\d\d\b|\(00\d\d[),/]|\b00\d\d/00\d\d\b|\bsince 00\d\d\b|\b00\d\d's\b")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_docs_cite_patches_by_feature() -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _docs()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if PATCH_NUMBER.search(line)
    ]
    assert not hits, "name the patch's feature instead of its number:\n" + "\n".join(hits)


def test_the_pattern_finds_the_forms_that_were_used() -> None:
    for text in ("(patch 0016)", "patches 0016, 0024", "(0008)", "0005/0006 that", "since 0024 the", "patch 0006's"):
        assert PATCH_NUMBER.search(text), text
    assert not PATCH_NUMBER.search("0.0016 s, 2026-11-25, 10024 tokens")


def test_upgrading_lists_the_mirrored_structs_of_the_module() -> None:
    """docs/upgrading-llama.md carries the list of C structs edgemoe mirrors as edgemoe.runtime.native.structs has
    it, not a hand-written one that drifts (it named 6 of 8 once)."""
    from edgemoe.runtime.native import structs

    text = (ROOT / "docs" / "upgrading-llama.md").read_text(encoding="utf-8")
    listed = text.split("<!-- structs: begin -->\n", 1)[1].split("<!-- structs: end -->", 1)[0]
    assert listed == structs.markdown()


# "issue 42", "issue #42", "issues 41 and 42", "(#42)": the issue tracker's numbers, which say nothing to a reader
# of the code; name the feature or the reason instead ("device prefill's buffers", "the prefill crash on the H100")
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+\b|\(#\d+\)", re.IGNORECASE)
SCANNED = ("edgemoe", "tests", "tools", "docs", ".ci", "Makefile", "README.md")
# what people write in; the corpora (.txt) and data (.json) quote the outside world
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cpp", ".supp"}


def _code_and_docs() -> list[Path]:
    skipped = {
        Path(__file__).resolve(),  # this file spells the forms out to test the pattern
    }
    files = []
    for name in SCANNED:
        top = ROOT / name
        for p in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if p.is_file() and "__pycache__" not in p.parts and p not in skipped and (
                    p.suffix in SCANNED_SUFFIXES or p.name == "Makefile" or p.parent.name == ".ci"):
                files.append(p)
    return files


def test_code_and_docs_name_no_issue_numbers() -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _code_and_docs()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert not hits, "name the feature or the reason instead of the issue's number:\n" + "\n".join(hits)


def test_the_issue_pattern_finds_the_forms_that_were_used() -> None:
    for text in ("(issue 42)", "issue #42", "Issue 41's goal", "(#42)", "issues 41 and 42", "issue 12, 2c"):
        assert ISSUE_NUMBER.search(text), text
    for text in ("0.42 s", "#128 experts", 'color="#888"', "kekzl/imp#1358", "llmfit #755", "the issue's target"):
        assert not ISSUE_NUMBER.search(text), text
