"""The held-out split rule and the fixture BPE trainer."""
from __future__ import annotations

import sys
from pathlib import Path

from edgemoe.calibration.corpus import default_corpus_dir, split_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "fixtures"))
from bpe import train_bpe  # noqa: E402


def test_split_holds_out_last_tenth_at_a_line_boundary(tmp_path: Path) -> None:
    p = tmp_path / "c.txt"
    p.write_text("".join(f"line {i:03d}\n" for i in range(100)))  # 9 bytes a line
    s = split_corpus(p)
    assert s.train_bytes[1] == s.heldout_bytes[0] and s.heldout_bytes[1] == 900
    assert s.train_text().endswith("\n") and s.heldout_text().startswith("line")
    assert 0.09 <= len(s.heldout_text()) / 900 <= 0.11
    assert s.train_text() + s.heldout_text() == p.read_text()


def test_project_corpora_exist() -> None:
    for name in ("tinyshakespeare.txt", "python-docs.txt"):
        assert (default_corpus_dir() / name).stat().st_size > 100_000


def test_bpe_merges_most_frequent_pair_first_and_is_deterministic() -> None:
    text = "low lower lowest " * 50 + "newer wider " * 10
    v1, m1 = train_bpe(text, 20)
    v2, m2 = train_bpe(text, 20)
    assert (v1, m1) == (v2, m2)
    assert len(v1) == 256 + len(m1)
    assert m1[0] == "o w"  # most frequent pair; the tie with "l o" goes to the larger pair
    assert "Ġlow" in v1
