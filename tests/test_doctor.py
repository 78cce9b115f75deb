"""`edgemoe doctor`: the CPU and the RPC stand-in checked in child processes; crashes and hangs are reported."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import stock_greedy
from edgemoe.analysis import doctor_child
from edgemoe.analysis.doctor import format_report, run_doctor, sanitizer_signal
from edgemoe.cli.main import cli

MODEL = Path(__file__).resolve().parent.parent / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


def test_cpu_and_rpc_steps_pass_and_match_stock() -> None:
    report = run_doctor(MODEL, rpc=True, timeout=300)
    assert [s.name for s in report.steps] == ["build", "devices", "cpu", "rpc ngl=0", "rpc ngl=999"]
    assert report.ok, format_report(report)
    build = report.step("build").data
    assert build["kind"] == "CPU" and build["patch_level"] >= build["required_patch_level"]
    assert "CPU" in build["backends"] and build["cuda_archs"] is None
    devices = report.step("devices").data["devices"]
    assert devices[0]["type"] == "CPU" and 0 < devices[0]["memory_free"] <= devices[0]["memory_total"]
    assert report.system["gpu"] is False and report.system["ram_total"] > 0
    # the CPU's 4 tokens are stock llama-cpp-python's greedy tokens; the RPC device's equal them
    _, stock = stock_greedy(MODEL, doctor_child.PROMPT, doctor_child.N_TOKENS)
    cpu = report.step("cpu").data
    assert cpu == {"device": "CPU", "tokens": stock}
    for name in ("rpc ngl=0", "rpc ngl=999"):
        data = report.step(name).data
        assert data["device"].startswith("RPC") and data["tokens"] == stock, (name, data)
    text = format_report(report)
    assert "gpu      none" in text and "result   all steps passed" in text


def test_crash_in_a_child_is_that_steps_failure_in_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_DOCTOR_FAULT", "generate:load")
    res = CliRunner().invoke(cli, ["doctor", "--json", "--model", str(MODEL)], catch_exceptions=False)
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert set(out) == {"ok", "first_failure", "system", "steps"}
    assert out["ok"] is False
    expected = "crashed with SIGSEGV during load"
    if "libasan" in os.environ.get("LD_PRELOAD", ""):  # make asan-test: ASan catches the signal, the child exits
        expected = "crashed with a fatal signal (AddressSanitizer) during load"
    assert out["first_failure"] == {"step": "cpu", "error": expected}
    steps = {s["name"]: s for s in out["steps"]}
    assert steps["build"]["ok"] and steps["devices"]["ok"]
    assert set(steps["cpu"]) == {"name", "ok", "seconds", "error", "phase", "data"}
    assert steps["cpu"]["phase"] == "load" and steps["cpu"]["data"] == {}


def test_hang_in_a_child_is_killed_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_DOCTOR_FAULT", "devices:query:hang")
    report = run_doctor(MODEL, timeout=20)
    first = report.first_failure
    assert first is not None and first.name == "devices"
    assert first.error == "no answer after 20 s during query (a hang): killed"
    assert report.step("cpu") is not None  # the later steps still ran
    assert "result   first failure: devices: no answer" in format_report(report)


def test_a_signal_a_sanitizer_caught_is_a_crash() -> None:
    """Under a sanitizer a crashing child exits with an error instead of dying by the signal."""
    assert sanitizer_signal("==1==ERROR: AddressSanitizer: SEGV on unknown address 0x0") == "SIGSEGV"
    assert sanitizer_signal("AddressSanitizer:DEADLYSIGNAL\n") == "a fatal signal (AddressSanitizer)"
    assert sanitizer_signal("RuntimeError: no model") is None
