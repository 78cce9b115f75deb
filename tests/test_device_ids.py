"""Each device proves which id rows it takes (edgemoe.runtime.device_ids): the series' id-row cases of
test-backend-ops run once per device and build; "raw" where they pass, "fill" where they fail, crash or hang, a
recorded result reused, an override (LoadConfig.device_ids, EDGEMOE_DEVICE_IDS) for the GPU check.

The choice is tested on fake devices and fake self-tests, the self-test's reading of test-backend-ops on fake
binaries (a failing case, a crash) and on the real one on the RPC device, and the whole path in a child that
opens an engine on the RPC device with an empty cache directory: the self-test runs, picks raw and is recorded,
and the next engine reads the record."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe.errors import InvalidConfigError
from edgemoe.runtime import device_ids
from edgemoe.runtime.config import LoadConfig
from edgemoe.runtime.device_ids import DeviceInfo, choose, run_selftest, setting_from
from edgemoe.runtime.op_tests import BACKEND_OPS_ENV, ID_ROW_CASES, series_total

from helpers.models import FIXTURE_MODELS

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"  # the scripts run in processes of their own
GPU = DeviceInfo(1, "CUDA0", "NVIDIA H100 80GB HBM3", "CUDA")
RPC = DeviceInfo(2, "RPC0", "127.0.0.1:50123", "RPC")


class FakeSelfTest:
    """Counts its runs; passes for the devices named in `passing`."""

    def __init__(self, *passing: str) -> None:
        self.passing = set(passing)
        self.runs: list[str] = []

    def __call__(self, dev: DeviceInfo) -> tuple[bool, str]:
        self.runs.append(dev.name)
        ok = dev.name in self.passing
        return ok, "174/174 id-row cases passed" if ok else f"2/174 of the series' cases passed on {dev.name}"


def test_selftest_picks_raw_where_it_passes_and_fill_where_it_fails(tmp_path: Path) -> None:
    path = tmp_path / "device-ids.json"
    st = FakeSelfTest("RPC0")
    got = choose([GPU, RPC], "auto", build="b1", path=path, selftest=st)
    assert [(c.device, c.mode, c.source) for c in got] == [("CUDA0", "fill", "self-test"), ("RPC0", "raw", "self-test")]
    assert "2/174" in got[0].note and got[1].note == ""
    assert got[0].handle == 1 and got[1].handle == 2
    assert st.runs == ["CUDA0", "RPC0"]
    # recorded per build and device: the next engine reads the record and runs nothing
    again = choose([GPU, RPC], "auto", build="b1", path=path, selftest=st)
    assert [(c.mode, c.source) for c in again] == [("fill", "recorded"), ("raw", "recorded")]
    assert again[0].note == got[0].note and st.runs == ["CUDA0", "RPC0"]
    # another build of the library proves itself again
    choose([GPU], "auto", build="b2", path=path, selftest=st)
    assert st.runs == ["CUDA0", "RPC0", "CUDA0"]
    # doctor runs it again whatever is recorded
    choose([GPU], "auto", build="b1", path=path, selftest=st, fresh=True)
    assert st.runs[-1] == "CUDA0" and len(st.runs) == 4


def test_an_rpc_server_is_recorded_without_its_port(tmp_path: Path) -> None:
    path = tmp_path / "device-ids.json"
    st = FakeSelfTest("RPC0")
    choose([RPC], "auto", build="b", path=path, selftest=st)
    other_port = DeviceInfo(3, "RPC0", "127.0.0.1:40001", "RPC")
    assert choose([other_port], "auto", build="b", path=path, selftest=st)[0].source == "recorded"
    assert st.runs == ["RPC0"] and RPC.rpc_endpoint == "127.0.0.1:50123" and GPU.rpc_endpoint is None
    assert list(json.loads(path.read_text())) == ["b/RPC0/127.0.0.1"]


def test_override_skips_the_selftest(tmp_path: Path) -> None:
    st = FakeSelfTest()
    for setting in ("raw", "fill"):
        got = choose([GPU, RPC], setting, build="b", path=tmp_path / "r.json", selftest=st)
        assert {(c.mode, c.source) for c in got} == {(setting, "override")}
    assert st.runs == [] and not (tmp_path / "r.json").exists()


def test_a_corrupt_record_is_run_again(tmp_path: Path) -> None:
    path = tmp_path / "device-ids.json"
    path.write_text('{"b/CUDA0/NVIDIA H100 80GB HBM3": {"raw": "yes"}, "junk": 3')  # cut short: not JSON
    st = FakeSelfTest("CUDA0")
    assert choose([GPU], "auto", build="b", path=path, selftest=st)[0].source == "self-test"
    path.write_text('{"b/CUDA0/NVIDIA H100 80GB HBM3": {"raw": "yes"}}')  # JSON, but not a record
    assert choose([GPU], "auto", build="b", path=path, selftest=st)[0].source == "self-test"
    assert json.loads(path.read_text())["b/CUDA0/NVIDIA H100 80GB HBM3"]["raw"] is True


def test_the_setting_comes_from_the_config_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_DEVICE_IDS", "raw")
    assert setting_from("auto") == "raw" and setting_from("fill") == "fill"
    monkeypatch.delenv("EDGEMOE_DEVICE_IDS")
    assert setting_from("auto") == "auto"
    monkeypatch.setenv("EDGEMOE_DEVICE_IDS", "yes")
    with pytest.raises(InvalidConfigError, match="EDGEMOE_DEVICE_IDS 'yes': use one of auto, raw, fill"):
        setting_from("auto")
    with pytest.raises(InvalidConfigError, match="device_ids 'sometimes': use one of auto, raw, fill"):
        LoadConfig(device_ids="sometimes")  # type: ignore[arg-type]  # the refusal is what is tested


FAILING_CASE = (
    "MUL_MAT_ID_SKIP(type_a=q6_K,type_b=f32,n_mats=8,n_used=4,b=0,m=64,n=129,k=256,amax=1.000000,m_v=0,"
    "skip=some): [MUL_MAT_ID_SKIP] NMSE = 0.912000000 > 0.000500000 \x1b[1;31mFAIL\x1b[0m"
)


def _fake_backend_ops(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "test-backend-ops"
    exe.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "argv") + "\n" + body)
    exe.chmod(0o755)
    monkeypatch.setenv(BACKEND_OPS_ENV, str(exe))
    return tmp_path / "argv"


def test_selftest_picks_fill_when_an_id_case_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = series_total(ID_ROW_CASES)
    argv = _fake_backend_ops(tmp_path, (
        f"printf '  {FAILING_CASE}\\n'\n"
        f"printf '  {n - 1}/{n} tests passed\\n  Backend CUDA0: \\033[1;31mFAIL\\033[0m\\n'\n"
        "exit 1\n"
    ), monkeypatch)
    raw, note = run_selftest(GPU)
    assert not raw and note.startswith(f"{n - 1}/{n} of the series' cases passed on CUDA0; first failure: ")
    assert "skip=some" in note
    assert argv.read_text().split() == ["test", "-b", "CUDA0", "-o", "MUL_MAT_ID_SKIP,ADD_ID_SKIP"]
    got = choose([GPU], "auto", build="b", path=tmp_path / "r.json")
    assert got[0].mode == "fill" and got[0].source == "self-test" and "first failure" in got[0].note


def test_selftest_picks_fill_when_the_cases_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the 2026-11-27 crash: an illegal address in MMQ's quantize kernel, a signal in test-backend-ops
    _fake_backend_ops(tmp_path, "printf '  MUL_MAT_ID_SKIP(type_a=q6_K,n=129,skip=some): '\nkill -SEGV $$\n",
                      monkeypatch)
    raw, note = run_selftest(GPU)
    assert not raw and note.startswith("test-backend-ops crashed with SIGSEGV on CUDA0 after: MUL_MAT_ID_SKIP(")


def test_selftest_reaches_an_rpc_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = series_total(ID_ROW_CASES)
    argv = _fake_backend_ops(tmp_path, f"printf '  {n}/{n} tests passed\\n'\n", monkeypatch)
    assert run_selftest(RPC)[0]
    assert argv.read_text().split()[-2:] == ["--rpc", "127.0.0.1:50123"]


def test_engine_on_the_rpc_device_proves_it_once(tmp_path: Path) -> None:
    """The whole path: no override, an empty cache directory; the first engine on the RPC device runs the real
    id-row cases over the server and records raw, the second reads the record; both equal the CPU's logits."""
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEMOE_DEVICE_IDS", BACKEND_OPS_ENV)}
    env["EDGEMOE_CACHE_DIR"] = str(tmp_path / "cache")
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        cmd = [sys.executable, str(HELPERS / "ids_check_child.py"), str(FIXTURE_MODELS[0]), "cache", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(out.read_text()))
    first, second = (r["device_ids"] for r in runs)
    assert [(d["device"], d["mode"], d["source"]) for d in first] == [("RPC0", "raw", "self-test")], first
    assert [(d["device"], d["mode"], d["source"]) for d in second] == [("RPC0", "raw", "recorded")], second
    assert all(r["equal"] and r["check"]["n_negative"] > 0 for r in runs), runs
    records = json.loads((tmp_path / "cache" / device_ids.RECORDS_NAME).read_text())
    assert [v["raw"] for v in records.values()] == [True], records


# host round trips per decoded token and cached layer on the RPC device (tests/helpers/rpc_round_trips.py; docs/
# architecture.md, "Id rows on a device"): measured fill 3.9 reads and 6.3 small writes, raw 2.9 and 5.3; the fill's
# mask used to come from the CPU too (7.3 writes). A guard against growth: no mode may cost more than this
ROUND_TRIP_BUDGET = {"fill": {"get_tensor": 4.1, "set_tensor": 6.5}, "raw": {"get_tensor": 3.1, "set_tensor": 5.5}}


def round_trips(tmp_path: Path, mode: str) -> dict:
    out = tmp_path / f"rtt-{mode}.json"
    env = {**os.environ, "EDGEMOE_DEVICE_IDS": mode}
    cmd = [sys.executable, str(HELPERS / "rpc_round_trips.py"), str(FIXTURE_MODELS[0]), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_round_trips_per_token_by_mode(tmp_path: Path) -> None:
    fill, raw = round_trips(tmp_path, "fill"), round_trips(tmp_path, "raw")
    n = fill["n_moe_layers"]
    for mode, r in (("fill", fill), ("raw", raw)):
        per_layer = {k: v / n for k, v in r["per_token"].items()}
        for kind, budget in ROUND_TRIP_BUDGET[mode].items():
            assert per_layer[kind] <= budget, (mode, kind, per_layer)
    # what fill costs over raw at each cached layer: the ids read back for the fill and the filled ids sent; the
    # same graph computes. The experts' loads differ from run to run (the load worker's timing decides which
    # misses are still in flight when the next token asks), so only that both modes load is checked
    assert fill["per_token"]["get_tensor"] - raw["per_token"]["get_tensor"] >= n - 1, (fill, raw)
    assert fill["per_token"]["set_tensor"] - raw["per_token"]["set_tensor"] >= n - 1, (fill, raw)
    assert fill["per_token"]["graph_compute"] == raw["per_token"]["graph_compute"], (fill, raw)
    assert fill["per_token"]["load"] > 0 and raw["per_token"]["load"] > 0, (fill, raw)
