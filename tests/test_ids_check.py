"""Id rows on a device in both modes: a device's mul_mat_id and add_id get the skipped slots (-1) of the cache's
misses, a gate's or a hook's drops either as they are ("raw": for a device whose kernels proved they skip them) or
filled with spare rows and masked ("fill"). llama_moe_set_ids_check counts the rows each mode hands over; the RPC
device stands in for a GPU (tests/helpers/ids_check_child.py runs each scenario in a process of its own).

- fill: only valid, distinct ids per token (no -1, nothing past the last row, no repeat);
- raw: -1 where skipped and otherwise valid, distinct ids (the -1 are counted: the mode does hand them over);
- both: the logits equal the CPU's (bitwise for the cache, whose layers' non-expert part runs on the CPU in both);
- LLAMA_MOE_DEVICE_IDS_DUMMY=1 (every miss on slot 0, a design that repeats ids): the checker counts the repeats.
The same checker runs on every architecture in both modes in tests/test_cache_rpc.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.models import FIXTURE_MODELS

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"  # the scripts run in processes of their own
CHILD = HELPERS / "ids_check_child.py"
MODES = ("fill", "raw")


def run_child(tmp_path: Path, model: Path, scenario: str, *, mode: str, dummy: bool = False) -> dict:
    """One scenario on the RPC device with EDGEMOE_DEVICE_IDS=mode; dummy: every skipped id filled with row 0."""
    out = tmp_path / f"{model.stem}-{scenario}-{mode}-{dummy}.json"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_DEVICE_IDS_DUMMY"}
    env["EDGEMOE_DEVICE_IDS"] = mode
    if dummy:
        env["LLAMA_MOE_DEVICE_IDS_DUMMY"] = "1"
    proc = subprocess.run([sys.executable, str(CHILD), str(model), scenario, str(out)], capture_output=True,
                          text=True, timeout=300, cwd=HERE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def holds(check: dict, mode: str) -> bool:
    """The mode's contract: no id past the last row and no repeat; fill also no -1."""
    ok = check["n_range"] == check["n_repeat"] == 0
    return ok and (mode == "raw" or (check["n_negative"] == 0 and check["first"] == ""))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.stem)
@pytest.mark.parametrize("scenario", ["cache", "prefill"])
def test_cache_hands_the_device_the_rows_of_its_mode(tmp_path: Path, model: Path, scenario: str, mode: str) -> None:
    r = run_child(tmp_path, model, scenario, mode=mode)
    assert [(d["device"], d["mode"], d["source"]) for d in r["device_ids"]] == [("RPC0", mode, "override")], r
    check = r["check"]
    assert check["n_nodes"] > 0 and check["n_rows"] > 0, r
    assert holds(check, mode), r
    if mode == "raw":  # the misses reach the device as -1: no fill ran
        assert check["n_negative"] > 0 and " -1" in check["first"], check
    assert r["equal"], r


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", ["gating", "hook-drop"])
def test_drops_on_a_device_in_each_mode(tmp_path: Path, scenario: str, mode: str) -> None:
    r = run_child(tmp_path, FIXTURE_MODELS[0], scenario, mode=mode)
    assert r["check"]["n_nodes"] > 0 and holds(r["check"], mode), r
    assert (r["check"]["n_negative"] > 0) == (mode == "raw"), r["check"]
    # every layer on the device against every layer on the CPU: the same kernels, the drops applied by the CPU's
    # skips there and by the device's skips (raw) or the fill and mask (fill) here
    assert r["nmse"] < 1e-9, r


def test_checker_counts_repeated_ids(tmp_path: Path) -> None:
    # a routing hook cannot repeat an expert (llama.cpp refuses the decode), and the tables never map two experts
    # to one slot: the repeats come from the one-dummy-slot design, every miss of a row on slot 0
    r = run_child(tmp_path, FIXTURE_MODELS[0], "cache", mode="fill", dummy=True)
    check = r["check"]
    assert check["n_repeat"] > 0 and check["n_negative"] == check["n_range"] == 0, check
    assert r["equal"], r  # the mask zeroes the dummy rows; the CPU's kernels read repeats as they are
