"""tools/gpu_check.sh's plumbing on the CPU: its dry run runs every step with stand-ins (a stub build, doctor,
two GPU tests each in a process of its own, test-backend-ops on the CPU, the sanitizer's test without the
sanitizer, a tiny bench, the profile cut at its cap) and leaves at most 8 files in $OUT, as the device returns."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from edgemoe.runtime.op_tests import BACKEND_OPS_ENV, series_total

from helpers.native_ops import backend_ops_exe

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS = ["build", "synth", "doctor", "tests", "ops", "sanitizer", "calibration", "bench", "prefill", "ctx",
         "profile"]


def _run(mode: str, out: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(["bash", str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.long  # every step of the GPU check: the long suite (`make test-long`)
def test_dry_run_runs_every_step_and_returns_at_most_8_files(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    exe = backend_ops_exe(tmp_path)  # the installed one, else built from the patched tree
    t0 = time.monotonic()
    proc = _run("dry-run", out, {"GPU_CHECK_WORK": str(work), BACKEND_OPS_ENV: str(exe)})
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.json", "ctx.json", "doctor.json", "gpu-tests.txt", "logs.tar.gz", "prefill.json",
                     "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    status = {line.split()[1]: line.split()[0] for line in summary[:-1]}
    assert status == {**{s: "ok" for s in STEPS}, "profile": "capped"}, summary  # the profile is cut at 3 s
    assert summary[-1].startswith("total: ") and summary[-1].endswith(f"0 failed steps, 7 files in {out}")
    assert json.loads((out / "doctor.json").read_text())["ok"] is True
    rows = [r["name"] for r in json.loads((out / "bench.json").read_text())["rows"]]
    assert rows[0].startswith("stock") and {"edgemoe lru", "edgemoe static", "edgemoe daop"} <= {
        " ".join(r.split()[:2]) for r in rows}, rows
    # the long-prompt prefill rows: each records the ubatch it ran (on the CPU nothing is planned: llama.cpp's 512,
    # cut to the bench's 256-token context)
    prefill = json.loads((out / "prefill.json").read_text())
    assert prefill["prompt_tokens"] == 64 and [r["n_ubatch"] for r in prefill["rows"]] == [256] * len(prefill["rows"])
    assert any(r["name"].endswith("+device prefill") for r in prefill["rows"]), prefill["rows"]
    # the 32K-context rows (8192 on the fixture): f16 and q8_0 KV; at f16 a +tiers row at the 4096 step
    # (at q8_0 the fixture's budget holds every expert at 8192 already: no step gains a slot, no row)
    ctx = json.loads((out / "ctx.json").read_text())
    assert sorted(ctx) == ["f16", "q8_0"] and all(r["decode_tps"] > 0 for run in ctx.values() for r in run["rows"])
    tiers = [r for r in ctx["f16"]["rows"] if r["name"].endswith("+tiers")]
    assert tiers and "steps 4096:32/8192:8" in tiers[0]["note"], ctx["f16"]["rows"]
    tests = (out / "gpu-tests.txt").read_text().splitlines()
    assert len(tests) == 2 and all(t.split()[0] in ("pass", "skip") for t in tests), tests
    with tarfile.open(out / "logs.tar.gz") as tf:
        names = set(tf.getnames())
    assert {"logs/doctor.err", "logs/backend-ops.log", "logs/sanitizer.log", "logs/bench.err", "logs/build.log",
            "logs/synth.log", "logs/prefill.err", "logs/ctx-f16.err", "logs/ctx-q8_0.err"} <= names
    assert sum(n.startswith("logs/tests/") and n.endswith(".log") for n in names) == 2
    assert f"{series_total()}/{series_total()} tests passed" in (work / "logs" / "backend-ops.log").read_text()
    assert (work / "tiny-qwen3moe.gguf").stat().st_size > 0  # written in the background beside the build
    assert seconds < 180, seconds  # about 45 s on an idle 2-core machine


def test_dry_run_of_the_id_row_rows(tmp_path: Path) -> None:
    """`ids` with CPU stand-ins: the op cases first, then the bench's stock rows and lru in both id-row modes with
    CUDA graphs on and off (four runs in ids.json), then the rows after a long prompt (depth.json)."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    proc = _run("ids", out, {"GPU_CHECK_WORK": str(work), "GPU_CHECK_DRY": "1",
                             BACKEND_OPS_ENV: str(backend_ops_exe(tmp_path))})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["depth.json", "ids.json", "logs.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary[:-1]] == [["ok", s] for s in ("synth", "ops", "ids", "depth")]
    ids = json.loads((out / "ids.json").read_text())
    assert sorted(ids) == sorted(f"ids-{m}-graphs-{g}" for g in ("off", "on") for m in ("fill", "raw")), list(ids)
    for run in ids.values():
        names = [r["name"] for r in run["rows"]]
        assert names[0].startswith("stock") and any(n.startswith("edgemoe lru") for n in names), names
        assert all(r["decode_tps"] > 0 for r in run["rows"]), run["rows"]
    depth = json.loads((out / "depth.json").read_text())
    assert depth["prompt_tokens"] == 256 and any(r["name"].startswith("edgemoe lru") for r in depth["rows"])


@pytest.mark.parametrize("extra", [3, 4])
def test_pack_refuses_more_files_than_the_device_returns(tmp_path: Path, extra: int) -> None:
    """The file-count check: 5 files of a run plus `extra` already in $OUT; 9 is one too many."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    for name in ("summary.txt", "gpu-tests.txt", "doctor.json", "bench.json", "logs/doctor.err"):
        (work / name).write_text("x\n")
    for i in range(extra):
        (out / f"left-{i}.txt").write_text("x\n")
    proc = _run("pack", out, {"GPU_CHECK_WORK": str(work)}, timeout=60)
    n = 5 + extra
    assert len(list(out.iterdir())) == n
    if n <= 8:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1
        assert f"error: {n} files in {out}, the device returns 8" in proc.stderr
