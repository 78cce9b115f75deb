"""The corpus split rule shared by fixtures, calibration and evaluation.

The last 10% of each corpus file (by bytes, cut at the next line boundary) is
held out: never train, calibrate or tune thresholds on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HELDOUT_FRACTION = 0.10


@dataclass(frozen=True)
class CorpusSplit:
    path: Path
    train_bytes: tuple[int, int]  # [start, end) byte range of the train split
    heldout_bytes: tuple[int, int]

    def train_text(self) -> str:
        return self._read(self.train_bytes)

    def heldout_text(self) -> str:
        return self._read(self.heldout_bytes)

    def _read(self, rng: tuple[int, int]) -> str:
        with self.path.open("rb") as f:
            f.seek(rng[0])
            return f.read(rng[1] - rng[0]).decode("utf-8", errors="replace")


def split_corpus(path: str | os.PathLike[str]) -> CorpusSplit:
    """Split a corpus file into train (first ~90%) and held-out (rest) at a line boundary."""
    p = Path(path)
    data = p.read_bytes()
    cut = int(len(data) * (1.0 - HELDOUT_FRACTION))
    nl = data.find(b"\n", cut)
    cut = len(data) if nl < 0 else nl + 1
    return CorpusSplit(path=p, train_bytes=(0, cut), heldout_bytes=(cut, len(data)))


def default_corpus_dir() -> Path:
    """EDGEMOE_CORPUS_DIR, else ../shared/corpus beside the repository (the project's corpora)."""
    env = os.environ.get("EDGEMOE_CORPUS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "corpus"
