"""Id rows on a device (patch "moe: id rows that a device's mul_mat_id accepts"): a device's mul_mat_id and
add_id kernels (CUDA's) read every id as a row of the stacked tensor and assume no id repeats within a token's
row, while the CPU's skip an id < 0. llama_moe_set_ids_check counts the rows a device would misread; the
RPC device stands in for a GPU (tests/ids_check_child.py runs each scenario in a process of its own).

- the expert cache, device prefill, gating and a hook's drops hand the device only valid, distinct ids, and
  their logits equal the CPU's (bitwise for the cache, whose layers' non-expert part runs on the CPU in both);
- with LLAMA_MOE_DEVICE_IDS_RAW=1 (the series' rows before the fill: a miss is -1) the checker counts the -1 rows,
  with =dummy (every miss on slot 0, a design that repeats ids) the repeated rows: the checker sees what crashed
  CUDA's MMQ.
The same checker runs on every architecture in tests/test_cache_rpc.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_MODELS

HERE = Path(__file__).resolve().parent
CHILD = HERE / "ids_check_child.py"


def run_child(tmp_path: Path, model: Path, scenario: str, *, raw: str = "") -> dict:
    """raw: LLAMA_MOE_DEVICE_IDS_RAW for the child: "1" the raw rows (-1 where skipped), "dummy" row 0 for every
    skipped id (the one-dummy-slot design, which repeats ids)."""
    out = tmp_path / f"{model.stem}-{scenario}-{raw}.json"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_DEVICE_IDS_RAW"}
    if raw:
        env["LLAMA_MOE_DEVICE_IDS_RAW"] = raw
    proc = subprocess.run([sys.executable, str(CHILD), str(model), scenario, str(out)], capture_output=True,
                          text=True, timeout=300, cwd=HERE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def clean(check: dict) -> bool:
    return check["n_negative"] == check["n_range"] == check["n_repeat"] == 0 and check["first"] == ""


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.stem)
@pytest.mark.parametrize("scenario", ["cache", "prefill"])
def test_cache_hands_the_device_valid_distinct_ids(tmp_path: Path, model: Path, scenario: str) -> None:
    r = run_child(tmp_path, model, scenario)
    assert r["check"]["n_nodes"] > 0 and r["check"]["n_rows"] > 0, r
    assert clean(r["check"]), r
    assert r["equal"], r


@pytest.mark.parametrize("scenario", ["gating", "hook-drop"])
def test_drops_on_a_device_are_filled_and_zeroed(tmp_path: Path, scenario: str) -> None:
    r = run_child(tmp_path, FIXTURE_MODELS[0], scenario)
    assert r["check"]["n_nodes"] > 0 and clean(r["check"]), r
    # every layer on the device against every layer on the CPU: the same kernels, the drops applied by the CPU's
    # skips there and by the fill and mask here
    assert r["nmse"] < 1e-9, r


def test_checker_counts_the_rows_of_the_raw_tables(tmp_path: Path) -> None:
    r = run_child(tmp_path, FIXTURE_MODELS[0], "cache", raw="1")
    check = r["check"]
    assert check["n_negative"] > 0 and check["n_range"] == check["n_repeat"] == 0, check
    assert " -1" in check["first"], check
    assert r["equal"], r  # the RPC device runs the CPU's kernels, which skip the -1 ids: only the checker sees them


def test_checker_counts_repeated_ids(tmp_path: Path) -> None:
    # a routing hook cannot repeat an expert (llama.cpp refuses the decode), and the tables never map two experts
    # to one slot: the repeats come from the one-dummy-slot design, every miss of a row on slot 0
    r = run_child(tmp_path, FIXTURE_MODELS[0], "cache", raw="dummy")
    check = r["check"]
    assert check["n_repeat"] > 0 and check["n_negative"] == check["n_range"] == 0, check
    assert r["equal"], r  # the mask zeroes the dummy rows; the CPU's kernels read repeats as they are
