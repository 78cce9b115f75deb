"""The repository's root and the bundled fixture models in models/."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_MODELS = sorted((ROOT / "models").glob("*.gguf"))
QWEN = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
MIXTRAL = ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"
