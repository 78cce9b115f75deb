"""`edgemoe doctor`: the CPU and the RPC stand-in checked in child processes; crashes and hangs are reported."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemoe.analysis import doctor_child
from edgemoe.analysis.doctor import (
    CLI_PROMPT,
    MIN_PROMPT_TOKENS,
    DoctorReport,
    StepResult,
    cli_steps,
    format_report,
    op_step,
    run_doctor,
    run_step,
    sanitizer_signal,
)
from edgemoe.cli.main import cli
from edgemoe.runtime.op_tests import BACKEND_OPS_ENV, series_total

from helpers.native_ops import backend_ops_exe
from helpers.stock import stock_greedy

MODEL = Path(__file__).resolve().parent.parent / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
STEPS = ["build", "devices", "cpu", "rpc ngl=0", "rpc ngl=999", "cli cpu", "cli cache", "ops CPU", "ids"]
# the crash doctor names when a child dies by SIGSEGV (under `make asan-test` ASan catches it and exits)
SEGV = "a fatal signal (AddressSanitizer)" if "libasan" in os.environ.get("LD_PRELOAD", "") else "SIGSEGV"


@pytest.fixture(scope="module")
def backend_ops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed test-backend-ops, else one built from the patched tree (a venv installed before it came)."""
    return backend_ops_exe(tmp_path_factory.mktemp("backend-ops"))


@pytest.fixture(autouse=True)
def _backend_ops_env(backend_ops: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_OPS_ENV, str(backend_ops))


def test_cpu_and_rpc_steps_pass_and_match_stock() -> None:
    report = run_doctor(MODEL, rpc=True, timeout=300)
    assert [s.name for s in report.steps] == STEPS
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
    # the CLI's generate: 64+ prompt tokens, the plain run is stock's, the cache on the RPC device loaded experts
    # in the prompt's multi-token ubatch and gave the same tokens
    _, stock_cli = stock_greedy(MODEL, CLI_PROMPT, doctor_child.N_TOKENS)
    plain, cached = report.step("cli cpu").data, report.step("cli cache").data
    assert plain["device"] == "CPU" and plain["cache"] is None and plain["tokens"] == stock_cli, plain
    assert cached["device"].startswith("RPC") and cached["tokens"] == stock_cli, cached
    assert cached["prompt_tokens"] == plain["prompt_tokens"] >= MIN_PROMPT_TOKENS
    assert cached["cache"]["misses"] > 0, cached
    assert report.step("ops CPU").data == {"backend": "CPU", "passed": series_total(), "total": series_total()}
    # the RPC device's id-row mode: the suite's override (tests/conftest.py), shown in the report
    ids = report.step("ids").data["devices"]
    assert [(d["device"], d["mode"], d["source"]) for d in ids] == [("RPC0", "fill", "override")], ids
    assert "RPC0: fill (override)" in format_report(report)
    text = format_report(report)
    assert "gpu      none" in text and "result   all steps passed" in text
    assert "ops CPU" in text and f"{series_total()}/{series_total()} of the series' op cases passed" in text


def test_crash_in_the_cli_cache_prefill_fails_doctor_where_the_short_steps_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault only in a multi-token ubatch with an expert cache (CUDA's MMQ crash on the cache's id rows): the
    4-token steps pass, the CLI step names the crash."""
    monkeypatch.setenv("EDGEMOE_DOCTOR_FAULT", "cli:prefill")
    report = run_doctor(MODEL, rpc=True, timeout=300)
    assert [s.name for s in report.steps if not s.ok] == ["cli cache"], format_report(report)
    assert report.first_failure is not None
    assert report.first_failure.error == (
        f"crashed with {SEGV} during generate: expert cache: 2 slots per MoE layer on RPC0, policy lru"
    )
    assert f"result   first failure: cli cache: crashed with {SEGV} during generate" in format_report(report)


def test_wrong_tokens_in_the_cli_cache_prefill_fail_the_cli_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_DOCTOR_FAULT", "cli:prefill:wrong")
    plain, cached = cli_steps(MODEL, True, 300)
    assert plain.ok and not cached.ok
    assert cached.data["tokens"] != plain.data["tokens"]
    assert cached.error == (
        f"tokens {cached.data['tokens']} differ from the plain CPU run's {plain.data['tokens']}"
    )


FAILING_CASE = (
    "MUL_MAT_ID_SKIP(type_a=q4_K,type_b=f32,n_mats=8,n_used=4,b=0,m=64,n=129,k=256,amax=1.000000,m_v=0,"
    "skip=some): [MUL_MAT_ID_SKIP] NMSE = 0.912000000 > 0.000500000 \x1b[1;31mFAIL\x1b[0m"
)


def _fake_backend_ops(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "test-backend-ops"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    monkeypatch.setenv(BACKEND_OPS_ENV, str(exe))


def test_ids_step_runs_the_devices_self_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor's ids step without an override: the RPC device's id-row cases run (again, whatever is recorded) and
    pick raw, which is recorded for the engines that open after it."""
    monkeypatch.delenv("EDGEMOE_DEVICE_IDS")
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(tmp_path))
    res = run_step("ids", {"kind": "device-ids", "rpc": True}, 300)
    assert res.ok, res.error
    [dev] = res.data["devices"]
    assert (dev["device"], dev["mode"], dev["source"], dev["note"]) == ("RPC0", "raw", "self-test", ""), dev
    assert json.loads((tmp_path / "device-ids.json").read_text()), "recorded"


def test_a_failing_series_case_fails_the_op_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = series_total()
    _fake_backend_ops(tmp_path, (
        "printf 'Backend 1/1: CUDA0\\n'\n"
        f"printf '  ADD_ID_SKIP(type_a=f32,n_mats=8): \\033[1;32mOK\\033[0m\\n'\n"
        f"printf '  {FAILING_CASE}\\n'\n"
        f"printf '  {n - 1}/{n} tests passed\\n  Backend CUDA0: \\033[1;31mFAIL\\033[0m\\n'\n"
        "exit 1\n"
    ), monkeypatch)
    res = op_step("CUDA0", 30)
    assert res.name == "ops CUDA0" and not res.ok
    case = FAILING_CASE.replace("\x1b[1;31mFAIL\x1b[0m", "FAIL")
    assert res.error == f"{n - 1}/{n} of the series' cases passed on CUDA0; first failure: {case}"


def test_a_crash_in_test_backend_ops_fails_the_op_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_backend_ops(tmp_path, "printf '  MOE_GATE(rule=2,n_rows=37): '\nkill -SEGV $$\n", monkeypatch)
    res = op_step("CUDA0", 30)
    assert not res.ok
    assert res.error == "test-backend-ops crashed with SIGSEGV on CUDA0 after: MOE_GATE(rule=2,n_rows=37):"


def test_a_missing_test_backend_ops_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_OPS_ENV, str(tmp_path / "absent"))
    res = op_step("CPU", 30)
    assert not res.ok and res.error is not None
    assert res.error.startswith(f"no test-backend-ops at {tmp_path / 'absent'}") and "make install" in res.error


def test_crash_in_a_child_is_that_steps_failure_in_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMOE_DOCTOR_FAULT", "generate:load")
    res = CliRunner().invoke(cli, ["doctor", "--json", "--model", str(MODEL)], catch_exceptions=False)
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert set(out) == {"ok", "first_failure", "system", "steps"}
    assert out["ok"] is False
    assert out["first_failure"] == {"step": "cpu", "error": f"crashed with {SEGV} during load"}
    steps = {s["name"]: s for s in out["steps"]}
    assert steps["build"]["ok"] and steps["devices"]["ok"]
    assert set(steps["cpu"]) == {"name", "ok", "seconds", "error", "phase", "data"}
    assert steps["cpu"]["phase"] == "load" and steps["cpu"]["data"] == {}


@pytest.mark.long  # waits out a child's timeout: the long suite (`make test-long`)
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


def test_report_names_a_library_that_carries_its_own_cxx_runtime() -> None:
    build = {"kind": "CUDA", "cuda_archs": "900", "patch_level": 26, "required_patch_level": 26,
             "llama_cpp_python": "0.3.36", "ggml_version": "0.25.3", "ggml_commit": "x", "cuda_runtime": None}
    guard = {"offenders": ["libggml-cuda.so.0"], "preloaded": "/lib/x86_64-linux-gnu/libstdc++.so.6", "too_late": False}
    clean = DoctorReport(system={}, steps=(StepResult("build", True, 0.1, data={**build, "cxx_runtime": {
        "offenders": [], "preloaded": None, "too_late": False}}),))
    assert "c++" not in format_report(clean)
    text = format_report(DoctorReport(system={}, steps=(StepResult("build", True, 0.1,
                                                                   data={**build, "cxx_runtime": guard}),)))
    assert ("c++      libggml-cuda.so.0 carries its own C++ runtime: loaded /lib/x86_64-linux-gnu/libstdc++.so.6 "
            "first") in text
    late = format_report(DoctorReport(system={}, steps=(StepResult("build", True, 0.1, data={
        **build, "cxx_runtime": {**guard, "preloaded": None, "too_late": True}}),)))
    assert "llama_cpp was imported before edgemoe" in late


def test_build_step_reports_the_cxx_runtime_guard() -> None:
    guard = doctor_child.build_info()["cxx_runtime"]
    # the venv's libraries link the system's runtime (tests/test_cxx_runtime.py): nothing to preload
    assert guard["offenders"] == [] and guard["preloaded"] is None and isinstance(guard["too_late"], bool), guard
