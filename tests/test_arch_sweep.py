"""edgemoe's features on every MoE architecture llama.cpp builds (issue 16), against stock llama.cpp.

The models are llama.cpp's own random-weight test models (tests/test-llama-archs.cpp, built and run
by tools/arch_models.py on first use into .build/arch-models; every MoE one has 2 experts and routes
to both), without the optional per-expert scale tensors ordinary GGUFs do not have. Per architecture:
- generate: Engine.generate, greedy, 16 tokens == llama_cpp.Llama's greedy ids;
- verify: `edgemoe verify MODEL --json` passes (identity, drop-last == stock k-1, swap);
- gating-cli: `edgemoe generate MODEL -p hi -n 4 --gating ser --threshold 0.9` runs;
- gating-top1: gating to the top-1 expert, in the graph and in the hook, == stock with k = 1,
  bitwise (drop-last == stock k-1 for these k = 2 models);
- cache: the lru expert cache on the CPU stand-in device == stock logits, bitwise.
test_with_optional_expert_scales runs generate, verify, gating-top1 and cache on the files as
written, per-expert ffn_*_exps.scale tensors included, for a few architectures (arch_models.KEEP_SCALED).

Everything that runs llama.cpp runs in a child process, so an abort fails that architecture's check
only; the in-process checks of one model share a child (tests/arch_sweep_check.py). The children of
the collected tests run EDGEMOE_SWEEP_JOBS (default: the CPU count) at a time, one thread each.
Known failures with a precise cause are strict xfails (XFAIL, XFAIL_SCALED).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import arch_models  # noqa: E402

WORKER = Path(__file__).resolve().parent / "arch_sweep_check.py"
WORKER_CHECKS = ("generate", "gating-top1", "cache")
TIMEOUT_S = 180

# (arch, check) pairs that fail for a known, precise reason: strict, so a fix shows up as XPASS
XFAIL: dict[tuple[str, str], str] = {}
# the same for test_with_optional_expert_scales
XFAIL_SCALED: dict[tuple[str, str], str] = {}


@functools.lru_cache(maxsize=1)
def _manifest() -> tuple[dict | None, str]:
    """tools/arch_models.py's manifest (built and generated on first use), or why there is none."""
    try:
        return arch_models.ensure(), ""
    except Exception as err:  # noqa: BLE001 - reported by test_models_generated, not as a collection error
        return None, f"{type(err).__name__}: {err}"


def _moe_entries() -> list[dict]:
    m, _ = _manifest()
    return arch_models.moe_entries(m) if m else []


SCALED_CHECKS = ("generate", "verify", "gating-top1", "cache")


def _param(entry: dict, check: str, *values: object) -> object:
    arch = entry["arch"]
    marks = []
    ident = "-".join([arch, *map(str, values)])
    key = (arch, values[0] if values else check)
    if key[1] == "gating-top1" and entry["n_expert_used"] < 2:
        ident += f"-k{entry['n_expert_used']}-nothing-to-drop"
        marks.append(pytest.mark.skip(reason=f"{arch} routes to k={entry['n_expert_used']} expert: nothing to drop"))
    elif key in (XFAIL_SCALED if values else XFAIL):
        marks.append(pytest.mark.xfail(strict=True, reason=(XFAIL_SCALED if values else XFAIL)[key]))
    return pytest.param(entry, *values, id=ident, marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    check = getattr(metafunc.function, "check", None)
    if "entry" not in metafunc.fixturenames or check is None:
        return
    entries = _moe_entries()
    if getattr(metafunc.function, "scaled", False):
        names = ["entry", "scaled_check"]
        params = [_param(e, check, c) for e in entries if e["scaled_file"] for c in SCALED_CHECKS]
    else:
        names = ["entry"]
        params = [_param(e, check) for e in entries]
    if not params:
        params = [pytest.param(*([None] * len(names)), id="no-models",
                               marks=pytest.mark.skip(reason="no MoE models; see test_models_generated"))]
    metafunc.parametrize(names, params)


def check(name: str, *, scaled: bool = False):  # type: ignore[no-untyped-def]
    """The check a test runs, for pytest_generate_tests; scaled: on the files with per-expert scales."""
    def mark(fn):  # type: ignore[no-untyped-def]
        fn.check = name
        fn.scaled = scaled
        return fn
    return mark


@pytest.fixture(scope="session")
def arch_manifest() -> dict:
    m, why = _manifest()
    if m is None:
        pytest.fail(f"tools/arch_models.py could not provide the models: {why}")
    return m


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["GGML_NO_BACKTRACE"] = "1"  # ggml's abort handler attaches gdb to print a backtrace, and can hang there
    return env


def _why(proc: subprocess.CompletedProcess | None, timeout: bool = False) -> str:
    """One line: how a child ended and the most telling line of its output."""
    if timeout or proc is None:
        return f"timed out after {TIMEOUT_S} s"
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
    lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
    keys = ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "abort", "failed", "Traceback")
    told = [ln for ln in lines if any(k in ln for k in keys) and not ln.startswith("@@ ")]
    line = told[-1] if told else lines[-1] if lines else "no output"
    return f"{how}: {line.replace(str(ROOT) + '/', '')[:400]}"


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess | None, bool]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT), False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return subprocess.CompletedProcess(cmd, -9, out, err), True


def _worker_results(path: Path) -> dict[str, dict]:
    """The in-process checks of one model: a child runs those not yet done; an abort blames the first
    check without a result and the child is started again for the others."""
    done: dict[str, dict] = {}
    while len(done) < len(WORKER_CHECKS):
        todo = [c for c in WORKER_CHECKS if c not in done]
        proc, timeout = _run([sys.executable, str(WORKER), str(path), *todo])
        for ln in proc.stdout.splitlines() if proc else []:
            if ln.startswith("@@ "):
                res = json.loads(ln[3:])
                done[res.pop("check")] = res
        missing = [c for c in todo if c not in done]
        if missing:
            done[missing[0]] = dict(ok=False, detail=f"llama.cpp aborted: {_why(proc, timeout)}")
    return done


def _verify(path: Path) -> tuple[bool, str]:
    proc, timeout = _run([sys.executable, "-m", "edgemoe", "verify", str(path), "--json", "-t", "1"])
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")] if proc else []
    if proc is None or timeout or not out:
        return False, f"edgemoe verify: {_why(proc, timeout)}"
    report = json.loads(out[-1])
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
    if proc.returncode != 0 or failed:
        return False, "; ".join(failed) or _why(proc)
    return True, "; ".join(f"{c['name']}: {c['detail']}" for c in report["checks"])


def _gating_cli(path: Path) -> tuple[bool, str]:
    proc, timeout = _run([sys.executable, "-m", "edgemoe", "generate", str(path), "-p", "hi", "-n", "4",
                          "--gating", "ser", "--threshold", "0.9", "--ctx", "128", "--temp", "0", "-t", "1", "--json"])
    if proc is None or timeout or proc.returncode != 0:
        return False, f"edgemoe generate --gating ser: {_why(proc, timeout)}"
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    ok = len(out["tokens"]) == 4 and out.get("gating", {}).get("path") == "graph"
    return ok, f"tokens {out['tokens']}, gating {out.get('gating')}"


def _job(path: Path, name: str) -> tuple[str, str]:
    """The unit of work behind a check: the in-process checks of a model share one child."""
    return (str(path), "worker" if name in WORKER_CHECKS else name)


def _run_job(path: Path, job: str) -> dict[str, tuple[bool, str]]:
    if job == "worker":
        return {c: (r["ok"], r["detail"]) for c, r in _worker_results(path).items()}
    return {job: (_verify if job == "verify" else _gating_cli)(path)}


class SweepPool:
    """Runs the children of the collected sweep tests SWEEP_JOBS at a time, in the tests' order, so the
    tests mostly collect finished results."""

    def __init__(self, wanted: list[tuple[Path, str]], jobs: int) -> None:
        self._ex = ThreadPoolExecutor(max_workers=max(1, jobs))
        self._futures: dict[tuple[str, str], Future] = {}
        for path, name in wanted:
            self._submit(path, name)

    def _submit(self, path: Path, name: str) -> Future:
        key = _job(path, name)
        if key not in self._futures:
            self._futures[key] = self._ex.submit(_run_job, path, key[1])
        return self._futures[key]

    def result(self, path: Path, name: str) -> tuple[bool, str]:
        return self._submit(path, name).result()[name]

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


def _wanted(item: pytest.Item) -> tuple[Path, str] | None:
    """(model, check) a collected sweep test will ask for, None for other tests."""
    fn = getattr(item, "function", None)
    spec = getattr(item, "callspec", None)
    if fn is None or spec is None or getattr(fn, "check", None) is None or item.get_closest_marker("skip"):
        return None
    entry = spec.params.get("entry")
    if entry is None:
        return None
    if fn.scaled:
        return arch_models.DEFAULT_OUT / entry["scaled_file"], spec.params["scaled_check"]
    return arch_models.DEFAULT_OUT / entry["file"], fn.check


@pytest.fixture(scope="session")
def sweep(request: pytest.FixtureRequest, arch_manifest: dict) -> Iterator[SweepPool]:
    wanted = [w for w in map(_wanted, request.session.items) if w is not None]
    pool = SweepPool(wanted, int(os.environ.get("EDGEMOE_SWEEP_JOBS", os.cpu_count() or 2)))
    yield pool
    pool.close()


# --------------------------------------------------------------------------- the sweep


def test_models_generated(arch_manifest: dict) -> None:
    """test-llama-archs wrote a model for every architecture it does not skip itself, and some are MoE."""
    failed = [f"{e['arch']}: {e['detail']}" for e in arch_manifest["archs"] if e["status"] == "failed"]
    assert arch_models.moe_entries(arch_manifest), "no MoE models"
    assert not failed, "\n".join(failed)


@check("generate")
def test_generate_equals_stock(sweep: SweepPool, entry: dict) -> None:
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["file"], "generate")
    assert ok, detail


@check("verify")
def test_verify_passes(sweep: SweepPool, entry: dict) -> None:
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["file"], "verify")
    assert ok, detail


@check("gating-cli")
def test_gating_cli_runs(sweep: SweepPool, entry: dict) -> None:
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["file"], "gating-cli")
    assert ok, detail


@check("gating-top1")
def test_gating_top1_equals_stock_k1(sweep: SweepPool, entry: dict) -> None:
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["file"], "gating-top1")
    assert ok, detail


@check("cache")
def test_expert_cache_equals_stock(sweep: SweepPool, entry: dict) -> None:
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["file"], "cache")
    assert ok, detail


@check("scaled", scaled=True)
def test_with_optional_expert_scales(sweep: SweepPool, entry: dict, scaled_check: str) -> None:
    """The models as test-llama-archs writes them, with per-expert ffn_*_exps.scale tensors."""
    ok, detail = sweep.result(arch_models.DEFAULT_OUT / entry["scaled_file"], scaled_check)
    assert ok, detail
