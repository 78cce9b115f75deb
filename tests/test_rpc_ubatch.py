"""Big prefill ubatches on the RPC device: the expert cache with device prefill gives stock llama.cpp's
logits bitwise at n_ubatch 512, 1024 and 2048 (tests/helpers/rpc_ubatch_check.py, in a process of its own), on the
bundled fixtures by default and on every architecture's random-weight model with -m slow. A new switch of the cache
(prefill borrowing slots) is one more entry of rpc_ubatch_check.VARIANTS: both tests check every variant."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.models import FIXTURE_MODELS

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"  # the scripts run in processes of their own
sys.path.insert(0, str(HERE.parent / "tools"))
import arch_models  # noqa: E402

UBATCHES = ("512", "1024", "2048")
PROMPT_TOKENS = 2048 + 64  # rpc_ubatch_check's
# architectures whose graph never routes through build_moe_ffn: nothing reaches the prefill buffers
NO_MOE_GRAPH = {"refact"}


def _run(tmp_path: Path, paths: list[Path], timeout: int) -> dict[str, dict]:
    result = tmp_path / "ubatch.json"
    proc = subprocess.run([sys.executable, str(HELPERS / "rpc_ubatch_check.py"), str(result), *map(str, paths)],
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert len(out) == len(paths), sorted(out)
    return out


def _check(name: str, r: dict) -> None:
    assert "error" not in r, (name, r)
    assert sorted(r, key=int) == list(UBATCHES), (name, r)
    for u in UBATCHES:
        for variant, v in r[u].items():
            assert v["equal"] and v["n_ubatch"] == int(u), (name, u, variant, v)
            if name.split(".")[0] not in NO_MOE_GRAPH:
                # the prompt's ubatches (not the decode steps) ran cached layers from the prefill buffers
                n = -(-PROMPT_TOKENS // int(u))
                assert v["prefill_layers"] > 0 and 0 < v["prefill_ubatches"] <= n, (name, u, variant, v)


def test_big_ubatches_on_the_rpc_device_equal_stock(tmp_path: Path) -> None:
    out = _run(tmp_path, list(FIXTURE_MODELS), timeout=900)
    for name, r in out.items():
        _check(name, r)


@pytest.mark.slow
def test_big_ubatches_on_every_moe_architecture(tmp_path: Path) -> None:
    try:
        manifest = arch_models.ensure()
    except Exception as err:  # noqa: BLE001 - the sweep's own test reports a failed build
        pytest.skip(f"no random-weight models: {type(err).__name__}: {err}")
    paths = [arch_models.DEFAULT_OUT / e["file"] for e in arch_models.moe_entries(manifest)]
    out = _run(tmp_path, paths, timeout=5400)
    assert len(out) > 40
    for name, r in out.items():
        _check(name, r)
