"""`edgemoe doctor`: what this machine and build are, and whether a model loads and generates on each device.

Every step that touches llama.cpp runs in a child process (analysis/doctor_child.py) under a timeout, so a
segfault or a hang is reported as that step's failure, with the phase it reached, never the end of doctor.
The steps: the build (CPU or CUDA and its architectures, patch level, ggml), the devices ggml sees (memory,
CUDA driver and runtime, PCIe link), then the bundled fixture with 0 and all layers offloaded on each GPU
(or on llama.cpp's RPC device on loopback, a GPU stand-in, when asked) and 4 greedy tokens compared with the
CPU's. Then what users run: `edgemoe generate --json` in a child of its own (the CLI's process) on a prompt of
64+ tokens, so that a multi-token ubatch runs, once plainly on the CPU and once with an expert cache of a few
slots on the GPU (or the RPC device with --rpc; the CPU stand-in without either), whose tokens must equal the
first's; and the series' op cases of llama.cpp's test-backend-ops on each GPU (on the CPU without one). The
system part (RAM, CPU) is read from /proc in this process.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.op_tests import OpTestError, run_series_cases
from .doctor_child import N_TOKENS

log = logging.getLogger(__name__)

ALL_LAYERS = 999  # n_gpu_layers: every layer
# the CLI step's prompt: 64+ tokens in every fixture's vocabulary, one multi-token ubatch (the path that crashed
# CUDA's MMQ kernels with the cache's id rows while 1-token steps ran clean)
CLI_PROMPT = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, that thou her "
    "maid art far more fair than she."
)
MIN_PROMPT_TOKENS = 64
CLI_SLOTS = 2  # expert slots per MoE layer: fewer than any fixture's experts, so misses and loads happen


@dataclass(frozen=True)
class StepResult:
    """One step: its name, whether it passed, and what it found or the one-line reason it failed."""

    name: str
    ok: bool
    seconds: float
    error: str | None = None  # one line
    phase: str | None = None  # the last phase the child reached (import, load, decode, ...)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DoctorReport:
    system: dict[str, Any]
    steps: tuple[StepResult, ...]

    @property
    def first_failure(self) -> StepResult | None:
        return next((s for s in self.steps if not s.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def step(self, name: str) -> StepResult | None:
        return next((s for s in self.steps if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "ok": self.ok,
            "first_failure": None if first is None else {"step": first.name, "error": first.error},
            "system": self.system,
            "steps": [asdict(s) for s in self.steps],
        }


def system_info() -> dict[str, Any]:
    """RAM and CPU of this machine, the Python and OS."""
    info: dict[str, Any] = {
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln)
        info["ram_total"] = int(mem["MemTotal"].split()[0]) * 1024
        info["ram_available"] = int(mem["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError) as err:
        log.debug("no /proc details: %s", err)
    return info


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def sanitizer_signal(err: str) -> str | None:
    """The fatal signal a sanitizer caught in a child (the child then exits instead of dying by it), None: none."""
    m = re.search(r"AddressSanitizer: (SEGV|BUS|FPE|ILL|ABRT) ", err)
    if m:
        return "SIG" + m.group(1)
    # with ASAN_OPTIONS=log_path the report goes to a file and stderr keeps this line only
    return "a fatal signal (AddressSanitizer)" if "AddressSanitizer:DEADLYSIGNAL" in err else None


def run_step(name: str, step: dict[str, Any], timeout: float) -> StepResult:
    """Run one step in a child process; a crash, a non-zero exit or the timeout is the step's failure."""
    with tempfile.TemporaryDirectory(prefix="edgemoe-doctor-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "edgemoe.analysis.doctor_child", json.dumps(step), result_path]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's whole session: no stray RPC server or worker
            out, err = proc.communicate()
            timed_out = True
        seconds = time.perf_counter() - t0
        result = Path(result_path).read_text() if os.path.exists(result_path) else None
    # native threads print to the same stdout: a marker may follow their text on a line
    phases = [ln[ln.index("PHASE ") + 6 :] for ln in out.splitlines() if "PHASE " in ln]
    phase = phases[-1] if phases else None
    sanitized = sanitizer_signal(err) if proc.returncode > 0 else None
    if timed_out:
        error = f"no answer after {timeout:.0f} s during {phase or 'start-up'} (a hang): killed"
    elif proc.returncode < 0 or sanitized:
        sig = signal.Signals(-proc.returncode).name if proc.returncode < 0 else sanitized
        last = _one_line(err)
        last = "" if "AddressSanitizer" in last else last  # the report's own line says no more than sig
        error = f"crashed with {sig} during {phase or 'start-up'}" + (f": {last}" if last else "")
    elif proc.returncode != 0 or result is None:
        error = f"failed during {phase or 'start-up'}: {_one_line(err) or f'exit status {proc.returncode}'}"
    else:
        return StepResult(name, True, seconds, phase=phase, data=json.loads(result))
    return StepResult(name, False, seconds, error=error, phase=phase)


def _failed(res: StepResult, error: str) -> StepResult:
    return StepResult(res.name, False, res.seconds, error=error, phase=res.phase, data=res.data)


def _differs(res: StepResult, ref: StepResult, what: str) -> StepResult:
    """res failed with a one-line reason when both passed and its tokens are not ref's."""
    if not (res.ok and ref.ok) or res.data["tokens"] == ref.data["tokens"]:
        return res
    return _failed(res, f"tokens {res.data['tokens']} differ from {what} {ref.data['tokens']}")


def device_steps(model: Path, gpus: list[str], rpc: bool, timeout: float) -> list[StepResult]:
    """The fixture on the CPU, then with 0 and all layers on each GPU (and the RPC device), 4 greedy tokens each."""
    gen = {"kind": "generate", "model": str(model)}
    cpu = run_step("cpu", {**gen, "n_gpu_layers": 0}, timeout)
    targets: list[tuple[str, dict[str, Any]]] = []
    if gpus:
        targets += [(f"gpu ngl={n}", {**gen, "n_gpu_layers": n}) for n in (0, ALL_LAYERS)]
    if rpc:
        targets += [(f"rpc ngl={n}", {**gen, "n_gpu_layers": n, "rpc": True}) for n in (0, ALL_LAYERS)]
    return [cpu, *(_differs(run_step(name, spec, timeout), cpu, "the CPU's") for name, spec in targets)]


def cli_argv(model: Path, *, cache: bool) -> list[str]:
    """`edgemoe generate`'s arguments of the CLI step: greedy, JSON, with or without an expert cache."""
    argv = [str(model), "-p", CLI_PROMPT, "-n", str(N_TOKENS), "--temp", "0", "--ctx", "256", "-t", "2"]
    if cache:
        argv += ["--expert-slots", str(CLI_SLOTS), "--policy", "lru", "--alloc", "equal"]
    return [*argv, "--json"]


def cli_steps(model: Path, rpc: bool, timeout: float) -> list[StepResult]:
    """`edgemoe generate` in the CLI's process shape: plainly on the CPU, then with an expert cache of a few slots
    on the first GPU (the RPC device with rpc, the CPU stand-in without either); the two must give the same tokens
    after a prompt long enough for a multi-token ubatch."""
    ref = run_step("cli cpu", {"kind": "cli", "argv": cli_argv(model, cache=False)}, timeout)
    res = run_step("cli cache", {"kind": "cli", "argv": cli_argv(model, cache=True), "rpc": rpc}, timeout)
    if res.ok and res.data["prompt_tokens"] < MIN_PROMPT_TOKENS:
        n = res.data["prompt_tokens"]
        res = _failed(res, f"the prompt was {n} tokens, under {MIN_PROMPT_TOKENS}: no multi-token ubatch ran")
    elif res.ok and res.data["cache"] is None:
        res = _failed(res, "edgemoe generate set up no expert cache with --expert-slots")
    return [ref, _differs(res, ref, "the plain CPU run's")]


def op_step(backend: str, timeout: float) -> StepResult:
    """The series' test-backend-ops cases on one backend; a failing case, a crash or a hang fails the step."""
    t0 = time.perf_counter()
    try:
        run = run_series_cases(backend, timeout=timeout)
    except OpTestError as err:
        return StepResult(f"ops {backend}", False, time.perf_counter() - t0, error=str(err))
    data = {"backend": backend, "passed": run.passed, "total": run.total}
    return StepResult(f"ops {backend}", True, run.seconds, data=data)


def run_doctor(model: Path, *, rpc: bool = False, timeout: float = 180.0) -> DoctorReport:
    """All steps in order; each device's generations are compared with the CPU's tokens."""
    steps: list[StepResult] = [run_step("build", {"kind": "build"}, timeout)]
    devices = run_step("devices", {"kind": "devices"}, timeout)
    steps.append(devices)
    gpus = [d["name"] for d in devices.data.get("devices", []) if d["type"] in ("GPU", "IGPU")]
    steps += device_steps(model, gpus, rpc, timeout)
    steps += cli_steps(model, rpc and not gpus, timeout)
    steps += [op_step(backend, timeout) for backend in gpus or ["CPU"]]
    if gpus or rpc:
        steps.append(run_step("ids", {"kind": "device-ids", "rpc": rpc and not gpus}, timeout))
    system = system_info()
    system["gpu"] = bool(gpus)
    return DoctorReport(system, tuple(steps))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _detail(data: dict[str, Any]) -> str:
    if "tokens" in data:
        return f"{data.get('device')}: tokens {data.get('tokens')}"
    if "passed" in data:
        return f"{data['passed']}/{data['total']} of the series' op cases passed"
    if "devices" in data and all("mode" in d for d in data["devices"]):
        # each device's id-row mode: raw (its kernels take -1) or fill (a CPU round trip per layer), and why
        return "; ".join(
            f"{d['device']}: {d['mode']} ({d['source']}){' ' + d['note'] if d['note'] else ''}"
            for d in data["devices"]
        )[:400]
    return ""


def _cxx_runtime_lines(guard: dict[str, Any]) -> list[str]:
    """A line when a library beside libllama carries its own C++ runtime (the loader's guard, docs/build.md)."""
    if not guard.get("offenders"):
        return []
    libs = ", ".join(guard["offenders"])
    if guard.get("too_late"):
        did = "llama_cpp was imported before edgemoe, so nothing could be done: import edgemoe first"
    else:
        did = f"loaded {guard.get('preloaded') or 'the system libstdc++.so.6'} first"
    return [f"c++      {libs} carries its own C++ runtime: {did}; rebuild (docs/build.md, 'The C++ runtime')"]


def format_report(report: DoctorReport) -> str:
    """The human-readable report: what to paste into a bug report."""
    s = report.system
    lines = [
        f"system   {s.get('cpu')} ({s.get('cpu_count')} threads), RAM {_gib(s.get('ram_total', 0))} "
        f"({_gib(s.get('ram_available', 0))} available), {s.get('os')}, Python {s.get('python')}"
    ]
    build = report.step("build")
    if build is not None and build.ok:
        b = build.data
        kind = b["kind"] + (f" (architectures {b['cuda_archs']})" if b.get("cuda_archs") else "")
        lines.append(
            f"build    {kind}, edgemoe patch level {b['patch_level']} (needs {b['required_patch_level']}), "
            f"llama-cpp-python {b['llama_cpp_python']}, ggml {b['ggml_version']} ({b['ggml_commit']})"
        )
        if b.get("cuda_runtime") is not None:
            lines.append(f"cuda     runtime {b['cuda_runtime']}, driver {b['cuda_driver'] or 'none'}")
        lines.extend(_cxx_runtime_lines(b.get("cxx_runtime") or {}))
    devices = report.step("devices")
    for d in devices.data.get("devices", []) if devices is not None else []:
        line = (
            f"device   {d['name']} ({d['type']}): {d['description']}, {_gib(d['memory_free'])} free of "
            f"{_gib(d['memory_total'])}"
        )
        nv = d.get("nvml")
        if nv:
            line += (
                f", driver {nv.get('driver')}, PCIe gen {nv.get('pcie_gen')} x{nv.get('pcie_width')}"
                f" (max gen {nv.get('pcie_gen_max')} x{nv.get('pcie_width_max')})"
            )
        lines.append(line)
    if not s.get("gpu"):
        lines.append("gpu      none: ggml sees no GPU (a CPU build, or no driver); checking the CPU")
    for st in report.steps:
        status = "ok  " if st.ok else "FAIL"
        detail = st.error or _detail(st.data)
        lines.append(f"{status}     {st.name:12} {st.seconds:6.1f} s  {detail}".rstrip())
    first = report.first_failure
    lines.append(
        "result   all steps passed"
        if first is None
        else f"result   first failure: {first.name}: {first.error}"
    )
    return "\n".join(lines)
