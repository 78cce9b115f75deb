"""The docs name patches by feature, not by number: numbers change when the series is regrouped (the 26-patch
series became 13 on 2026-11-25 and left 44 stale references). patches/README.md, which defines the numbers, is
the one place that may use them."""

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
