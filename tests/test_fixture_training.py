"""The fixture trainer end to end on a tiny budget: deterministic for a seed, with a faithful export."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "fixtures" / "train_fixture.py"


def _train(out: Path, seed: int) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--preset", "mixtral", "--steps", "3", "--batch", "2", "--threads", "1",
           "--eval-chunks", "2", "--max-train-bytes", "120000", "--seed", str(seed),
           "--out-dir", str(out), "--work-dir", str(out / "work")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return json.loads((out / "edgemoe-tiny-mixtral.json").read_text())


@pytest.mark.long  # trains twice: the long suite (`make test-long`)
def test_training_is_deterministic_and_export_faithful(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", seed=7)
    b = _train(tmp_path / "b", seed=7)
    assert a["sha256"] == b["sha256"]  # same seed, same steps, same threads: identical GGUF
    assert a["heldout_perplexity"] == b["heldout_perplexity"]
    for res in a["heldout_perplexity"].values():
        # torch and llama.cpp on the F32 export agree closely; Q4_K_M stays near them
        assert abs(res["llama_cpp_f32_gguf"] / res["torch_f32"] - 1) < 1e-3
        assert abs(res["llama_cpp_q4_k_m_gguf"] / res["torch_f32"] - 1) < 0.05
    assert (tmp_path / "a" / "edgemoe-tiny-mixtral.md").read_text().startswith("# edgemoe-tiny-mixtral")
    assert not list((tmp_path / "a").glob("*.tmp"))
