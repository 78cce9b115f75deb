"""Run a script of tests/helpers/ on one model in a process of its own (a registered RPC device is seen by every
model loaded afterwards in a process) and read the JSON object it writes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_child(script: str, model: Path, tmp_path: Path, *, timeout: float = 600) -> dict[str, Any]:
    """`python tests/helpers/<script> MODEL OUT.json` in tests/, asserting it exits 0; its JSON object."""
    result = tmp_path / f"{Path(script).stem}-{model.stem}.json"
    proc = subprocess.run([sys.executable, str(HERE / script), str(model), str(result)],
                          capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())
