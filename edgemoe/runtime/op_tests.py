"""The series' op tests in llama.cpp's test-backend-ops, as installed beside edgemoe (doctor's `ops` step).

`tools/build_llama.py` compiles llama.cpp's tests/test-backend-ops.cpp from the patched tree against the
libraries it just installed and puts it, with the ggml headers it was compiled with, in NATIVE_TOOLS_DIR of
the virtual environment, so that doctor and the op tests find them where only the installed package is.
test-backend-ops compares a backend (CUDA0) with the CPU backend case by case; on the CPU it compares the CPU
with itself, which still catches a crash, a NaN or a write outside an output (its sentinels).

Stdlib only: tools/build_llama.py imports NATIVE_TOOLS_DIR from here before any edgemoe dependency exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# under the virtual environment's prefix: test-backend-ops and include/ (the ggml headers it was built with)
NATIVE_TOOLS_DIR = Path("share") / "edgemoe"
BACKEND_OPS_NAME = "test-backend-ops"
# the series' cases in llama.cpp's test-backend-ops (op name -> how many cases it registers)
SERIES_CASES = {"MUL_MAT_ID_SKIP": 168, "ADD_ID_SKIP": 6, "MOE_GATE": 36}
# of those, the id-row cases: skipped ids (-1) on every mul_mat_id / add_id path of a device (a device's self-test)
ID_ROW_CASES = {op: SERIES_CASES[op] for op in ("MUL_MAT_ID_SKIP", "ADD_ID_SKIP")}
# a stand-in binary for doctor's tests (a script printing a failing case, one that crashes)
BACKEND_OPS_ENV = "EDGEMOE_TEST_BACKEND_OPS"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY = re.compile(r"^\s*(\d+)/(\d+) tests passed", re.M)


class OpTestError(RuntimeError):
    """test-backend-ops is missing, crashed, hung or reported failing cases; the message says which and what to do."""


@dataclass(frozen=True)
class OpTestRun:
    """One backend's run of the series' cases."""

    backend: str
    passed: int
    total: int
    seconds: float


def native_tools_dir(prefix: str | Path | None = None) -> Path:
    """Where the installed test-backend-ops and ggml headers are (sys.prefix: this environment's)."""
    return Path(prefix or sys.prefix) / NATIVE_TOOLS_DIR


def installed_include_dir(prefix: str | Path | None = None) -> Path:
    return native_tools_dir(prefix) / "include"


def backend_ops_binary() -> Path:
    """The test-backend-ops doctor runs: $EDGEMOE_TEST_BACKEND_OPS, else the installed one."""
    given = os.environ.get(BACKEND_OPS_ENV)
    exe = Path(given) if given else native_tools_dir() / BACKEND_OPS_NAME
    if not os.access(exe, os.X_OK):
        raise OpTestError(
            f"no test-backend-ops at {exe}: the native library was installed before it came with edgemoe; "
            "run `make install` (`.venv/bin/python tools/build_llama.py --force` builds it)"
        )
    return exe


def series_total(cases: dict[str, int] | None = None) -> int:
    return sum((cases or SERIES_CASES).values())


def first_failure(output: str, cases: dict[str, int] | None = None) -> str | None:
    """The first case line that did not end in OK (FAIL, not supported, an error), without colour codes."""
    for line in _ANSI.sub("", output).splitlines():
        text = line.strip()
        if text.startswith(tuple(f"{op}(" for op in cases or SERIES_CASES)) and not text.endswith(": OK"):
            return text[:300]
    return None


def check_output(backend: str, returncode: int, output: str, cases: dict[str, int] | None = None) -> int:
    """The number of cases that passed; OpTestError naming the first failing case or the crash otherwise."""
    total = series_total(cases)
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        last = first_failure(output, cases) or _last_line(output)
        raise OpTestError(
            f"test-backend-ops crashed with {sig} on {backend}" + (f" after: {last}" if last else "")
        )
    m = _SUMMARY.search(_ANSI.sub("", output))
    passed = int(m.group(1)) if m else 0
    counted = int(m.group(2)) if m else 0
    failure = first_failure(output, cases)
    if returncode == 0 and passed == counted == total and failure is None:
        return passed
    what = f"{passed}/{total} of the series' cases passed on {backend}"
    if counted != total and m:
        what += f" ({counted} ran: test-backend-ops is not the patched tree's, run `make install`)"
    detail = failure or _last_line(output) or f"exit status {returncode}"
    raise OpTestError(f"{what}; first failure: {detail}")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_series_cases(
    backend: str, *, timeout: float = 120.0, cases: dict[str, int] | None = None, rpc: str | None = None
) -> OpTestRun:
    """test-backend-ops with the series' cases (or `cases` of them) on one backend (CUDA0, CPU; RPC0 with rpc, the
    HOST:PORT of its server); OpTestError unless all pass."""
    cases = cases or SERIES_CASES
    exe = backend_ops_binary()
    cmd = [str(exe), "test", "-b", backend, "-o", ",".join(cases), *(["--rpc", rpc] if rpc else [])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise OpTestError(
            f"test-backend-ops gave no answer on {backend} after {timeout:.0f} s (a hang): killed"
        ) from err
    passed = check_output(backend, proc.returncode, proc.stdout + proc.stderr, cases)
    return OpTestRun(backend, passed, series_total(cases), time.perf_counter() - t0)
