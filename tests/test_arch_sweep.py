"""edgemoe's features on every MoE architecture llama.cpp builds, against stock llama.cpp.

The models are llama.cpp's own random-weight test models (tests/test-llama-archs.cpp, built and run
by tools/arch_models.py on first use into .build/arch-models; every MoE one has 2 experts and routes
to both), without the optional per-expert scale tensors and the 0.0 norm epsilons ordinary GGUFs do not
have (arch_models.rewrite_gguf). Per architecture:
- generate: Engine.generate, greedy, 16 tokens == llama_cpp.Llama's greedy ids;
- verify: `edgemoe verify MODEL --json` passes (identity, drop-last == stock k-1, swap);
- gating-cli: `edgemoe generate MODEL -p hi -n 4 --gating ser --threshold 0.9` runs;
- kld: `edgemoe perplexity --kl-divergence-base` then `--kl-divergence` against itself (KLD 0, same top 1) and
  with gating to the top-1 expert (KLD > 0);
- gating-top1: gating to the top-1 expert, in the graph and in the hook, == stock with k = 1,
  bitwise (drop-last == stock k-1 for these k = 2 models);
- cache: the lru expert cache on the CPU stand-in device == stock logits, bitwise.
- speculate: greedy speculative decoding (prompt lookup; the model drafting for itself) with the lru cache
  == the engine's greedy one token per decode.
- cache-static: the static expert cache, calibrated on first use (edgemoe.calibration.auto), == stock
  logits, bitwise.
- cache-daop: the daop policy, calibrated on first use, run natively (prompt swap) == stock logits, bitwise.
- cache-dali: DALI's replacement run natively == stock logits, bitwise, no host sync.
- cache-promoe (on the .k1 copies): ProMoE's prefetcher with one slot == stock logits, bitwise, with
  prefetches issued; cache-dali-prefetch the same for dali with its prefetcher; cache-assign for lru with
  the CPU/GPU assigner (routes weighed), cache-degrade for graceful degradation at r = 1 (routes read).
- cache-precalc (also on the .k1 and .scaled copies): DAOP's pre-calculation from layer 1 with
  no expert resident: the prompt's rows == stock bitwise, finite decode rows, every MoE layer that follows a
  MoE layer taking experts early at every decode step; every expert resident == stock bitwise. The output
  changes by design, so its arithmetic is checked against the torch reference on the fixtures
  (tests/test_precalc.py); models whose first layer is dense have no such layer here (nothing runs early).
- cache-borrow: device prefill whose buffers borrow the last cached layers' slots, two prompts with decode
  steps == stock logits bitwise, lent and refilled twice (a model with one cached layer: refused, typed).
- context-tiers: the context created in steps (256, 512) and re-created across them, with a new prompt and a
  restored snapshot == stock logits bitwise (deepseek4, LongRoPE models: refused, typed).
test_one_expert_per_token runs them on copies with expert_used_count 1 (the router chooses one of
the two experts); test_with_optional_expert_scales on the files with the per-expert ffn_*_exps.scale
tensors and test_files_as_llama_cpp_wrote_them_load loads the files as written, for a few
architectures (arch_models.KEEP_SCALED).

Everything that runs llama.cpp runs in a child process, so an abort fails that architecture's check
only; the in-process checks of one model share a child (tests/helpers/arch_sweep_check.py). The children of
the collected tests run EDGEMOE_SWEEP_JOBS (default: the CPU count) at a time, one thread each.
Known failures with a precise cause are strict xfails (XFAIL, XFAIL_SMALLER_K, XFAIL_VARIANT).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# the architecture sweep: every MoE architecture llama.cpp loads, minutes on 2 cores (`make test-long`, CI)
pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import arch_models  # noqa: E402

WORKER = Path(__file__).resolve().parent / "helpers" / "arch_sweep_check.py"
# the in-process checks (tests/helpers/arch_sweep_check.py): an architecture's own file runs BASE_WORKER_CHECKS,
# a variant file those of its VARIANT_CHECKS
BASE_WORKER_CHECKS = ("generate", "speculate", "gating-top1", "cache", "cache-static", "cache-daop", "cache-dali", "cache-precalc",
                      "cache-borrow", "context-tiers")
WORKER_CHECKS = (*BASE_WORKER_CHECKS, "cache-promoe", "cache-dali-prefetch", "cache-assign", "cache-degrade",
                 "scale-applies")
TIMEOUT_S = 180

# (arch, check) pairs that fail for a known, precise reason: strict, so a fix shows up as XPASS
_DIFFUSION = ("stock llama_cpp.Llama cannot run it: a diffusion LM has no KV cache (llama_get_memory is "
              "NULL) and Llama.generate asserts 'Memory is not initialized' (llama_cpp/_internals.py "
              "kv_cache_seq_rm); greedy next-token generation is not how these models generate anyway")
_REFACT = ("llama.cpp's refact graph (src/models/refact.cpp) never calls build_moe_ffn: the loader creates "
           "expert tensors for it but nothing routes to them, so there is no route to hook, gate or cache")
XFAIL: dict[tuple[str, str], str] = {
    ("llada-moe", "generate"): _DIFFUSION,
    ("rnd1", "generate"): _DIFFUSION,
    ("refact", "verify"): _REFACT + " (verify: 'the hook was never called')",
    ("refact", "gating-top1"): _REFACT,
    ("refact", "kld"): _REFACT + " (nothing for gating to drop: KLD 0 with top-1 gating)",
    ("refact", "cache"): _REFACT + " (0 hits, 0 loads)",
    ("refact", "cache-static"): _REFACT + " (0 hits)",
    ("refact", "cache-dali"): _REFACT + " (0 hits, 0 loads)",
    ("refact", "cache-daop"): _REFACT + " (0 hits)",
    ("refact", "cache-promoe"): _REFACT + " (the cache was not used)",
    ("refact", "cache-dali-prefetch"): _REFACT + " (the cache was not used)",
    ("refact", "cache-assign"): _REFACT + " (the cache was not used)",
    ("refact", "cache-degrade"): _REFACT + " (the cache was not used)",
    ("refact", "cache-precalc"): _REFACT + " (no layer took experts early)",
    ("refact", "cache-borrow"): _REFACT + " (lent, but nothing routed to refill them with)",
}
# (arch, check) that compare dropping experts with stock at a smaller top-k, where that cannot be equal;
# only where k >= 2 (the .k1 copies have nothing to drop: verify skips drop-last, gating-top1 is skipped)
_GROVE_K = ("grovemoe calls build_moe_ffn twice per layer (src/models/grovemoe.cpp): its experts ffn_*_exps "
            "with top-k, then its chunk experts ffn_*_chexps with top-min(k, n_chunk_expert) of the same "
            "logits; the hook and the gating act on the experts' call only, the chunk call runs "
            "as stock with top-min(k, n_chunk_expert), but stock with a smaller k also lowers the chunk "
            "call's top-k (here n_chunk_expert = 2 = k), so the chunk experts differ")
XFAIL_SMALLER_K: dict[tuple[str, str], str] = {
    ("grovemoe", "verify"): _GROVE_K + " (drop-last vs stock k-1; identity and swap pass)",
    ("grovemoe", "gating-top1"): _GROVE_K + " (top-1 of k = 2 vs stock k = 1, in the graph and the hook)",
}
# (arch, variant, check) of the variant files (VARIANT_CHECKS), beside XFAIL
XFAIL_VARIANT: dict[tuple[str, str, str], str] = {}


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


# the checks run on an architecture's other files (arch_models: <arch>.scaled.gguf, <arch>.k1.gguf;
# the weight-scale copies below)
VARIANT_CHECKS = {"scaled": ("generate", "verify", "gating-top1", "cache", "cache-precalc"),
                  "k1": ("generate", "verify", "gating-cli", "gating-top1", "cache", "cache-promoe",
                         "cache-dali-prefetch", "cache-assign", "cache-degrade", "cache-precalc"),
                  "wscale": ("generate", "verify", "gating-top1", "cache", "scale-applies")}

# Architectures whose graph reads expert_weights_scale and expert_weights_norm (test-llama-archs writes
# 0.0, which llama.cpp takes as no scale, and false): copies with the weights normalised and scaled by
# 2.5 (deepseek-v3 style; sigmoid gating for most of these), written by the sweep fixture into WSCALE_DIR
WEIGHT_SCALE_ARCHS = ("deepseek", "deepseek2", "glm4moe", "dots1", "bailingmoe2", "afmoe")
WEIGHT_SCALE = {"expert_weights_scale": 2.5, "expert_weights_norm": True}
WSCALE_DIR = arch_models.DEFAULT_OUT.with_name("arch-models-wscale")


def _file(entry: dict, variant: str) -> Path:
    """An architecture's model: "" <arch>.gguf, else <arch>.<variant>.gguf (scaled, k1, raw), or its
    weight-scale copy (wscale)."""
    if variant == "wscale":
        return WSCALE_DIR / entry["file"]
    return arch_models.DEFAULT_OUT / entry[f"{variant}_file" if variant else "file"]


def _has_variant(entry: dict, variant: str) -> bool:
    if variant == "wscale":
        return entry["arch"] in WEIGHT_SCALE_ARCHS
    return not variant or bool(entry[f"{variant}_file"])


def _write_weight_scale_copies(manifest: dict) -> None:
    """WSCALE_DIR/<arch>.gguf for WEIGHT_SCALE_ARCHS, (re)written when older than the model it copies."""
    WSCALE_DIR.mkdir(parents=True, exist_ok=True)
    for e in arch_models.moe_entries(manifest):
        if e["arch"] not in WEIGHT_SCALE_ARCHS:
            continue
        src, dst = arch_models.DEFAULT_OUT / e["file"], WSCALE_DIR / e["file"]
        if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
            tmp = dst.with_suffix(".tmp")
            arch_models.rewrite_gguf(src, tmp, scales=False, values=WEIGHT_SCALE)
            os.replace(tmp, dst)


def _param(entry: dict, check: str, variant: str = "") -> object:
    arch = entry["arch"]
    marks = []
    ident = f"{arch}-{check}" if variant in VARIANT_CHECKS else arch
    k = 1 if variant == "k1" else entry["n_expert_used"]
    # XFAIL holds for the .k1 copies too: they differ in k only
    xfail = XFAIL_VARIANT.get((arch, variant, check)) or (
        XFAIL.get((arch, check)) if variant in ("", "k1") else None) or (
        XFAIL_SMALLER_K.get((arch, check)) if k >= 2 else None)
    if check == "gating-top1" and k < 2:
        ident += f"-k{k}-nothing-to-drop"
        marks.append(pytest.mark.skip(reason=f"{arch}: k={k}, gating has nothing to drop"))
    elif xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=xfail))
    values = (entry, check) if variant in VARIANT_CHECKS else (entry,)
    return pytest.param(*values, id=ident, marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    check = getattr(metafunc.function, "check", None)
    if "entry" not in metafunc.fixturenames or check is None:
        return
    variant = metafunc.function.variant
    entries = [e for e in _moe_entries() if _has_variant(e, variant)]
    if variant in VARIANT_CHECKS:
        names = ["entry", "variant_check"]
        params = [_param(e, c, variant) for e in entries for c in VARIANT_CHECKS[variant]]
    else:
        names = ["entry"]
        params = [_param(e, check, variant) for e in entries]
    if not params:
        params = [pytest.param(*([None] * len(names)), id="no-models",
                               marks=pytest.mark.skip(reason="no MoE models; see test_models_generated"))]
    metafunc.parametrize(names, params)


def check(name: str, *, variant: str = ""):  # type: ignore[no-untyped-def]
    """The check a test runs and on which files (_file), for pytest_generate_tests; a variant in
    VARIANT_CHECKS runs each of its checks, given as the variant_check argument."""
    def mark(fn):  # type: ignore[no-untyped-def]
        fn.check = name
        fn.variant = variant
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
    env["GGML_NO_BACKTRACE"] = "1"  # ggml's abort handler attaches gdb for a backtrace, and can hang there
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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT)
        return proc, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return subprocess.CompletedProcess(cmd, -9, out, err), True


def _worker_checks(path: Path) -> tuple[str, ...]:
    """The in-process checks a model's tests ask for (a variant file: its VARIANT_CHECKS)."""
    variant = ("wscale" if path.parent == WSCALE_DIR else "k1" if path.name.endswith(".k1.gguf")
               else "scaled" if path.name.endswith(".scaled.gguf") else "")
    wanted = VARIANT_CHECKS.get(variant, BASE_WORKER_CHECKS)
    return tuple(c for c in WORKER_CHECKS if c in wanted)


def _worker_results(path: Path) -> dict[str, dict]:
    """The in-process checks of one model: a child runs those not yet done; an abort blames the first
    check without a result and the child is started again for the others."""
    done: dict[str, dict] = {}
    checks = _worker_checks(path)
    while len(done) < len(checks):
        todo = [c for c in checks if c not in done]
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
                          "--gating", "ser", "--threshold", "0.9", "--ctx", "128", "--temp", "0", "-t", "1",
                          "--json"])
    if proc is None or timeout or proc.returncode != 0:
        return False, f"edgemoe generate --gating ser: {_why(proc, timeout)}"
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    ok = len(out["tokens"]) == 4 and out.get("gating", {}).get("path") == "graph"
    return ok, f"tokens {out['tokens']}, gating {out.get('gating')}"


def _load_cli(path: Path) -> tuple[bool, str]:
    proc, timeout = _run([sys.executable, "-m", "edgemoe", "generate", str(path), "-p", "hi", "-n", "2",
                          "--ctx", "128", "--temp", "0", "-t", "1", "--json"])
    if proc is None or timeout or proc.returncode != 0:
        return False, f"edgemoe generate: {_why(proc, timeout)}"
    return True, "loads and generates"


KLD_TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east.\n" * 20


def _kld_cli(path: Path) -> tuple[bool, str]:
    """`edgemoe perplexity --kl-divergence-base` then `--kl-divergence` against itself (KLD 0, the same top token
    everywhere) and with gating to the top-1 expert (KLD > 0): one pass each."""
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text, base = Path(tmp) / "t.txt", Path(tmp) / "base.kld"
        text.write_text(KLD_TEXT)
        for name, extra in (("base", ["--kl-divergence-base", str(base)]), ("self", ["--kl-divergence", str(base)]),
                            ("top-1", ["--kl-divergence", str(base), "--gating", "score", "--threshold", "0"])):
            proc, timeout = _run([sys.executable, "-m", "edgemoe", "perplexity", str(path), "--input", str(text),
                                  "--ctx", "64", "--max-tokens", "192", "-t", "1", "--json", *extra])
            out = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")] if proc else []
            if proc is None or timeout or proc.returncode != 0 or not out:
                return False, f"perplexity ({name}): {_why(proc, timeout)}"
            runs[name] = json.loads(out[-1])["kld"]
    same, gated = runs["self"], runs["top-1"]
    ok = same["mean_kld"] == 0.0 and same["same_top"] == 1.0 and gated["mean_kld"] > 0.0
    return ok, (f"{runs['base']['rows']} tokens; against itself KLD {same['mean_kld']:.3g}, same top "
                f"{same['same_top']:.3f}; top-1 gating KLD {gated['mean_kld']:.3g}, same top {gated['same_top']:.3f}")


_CLI_JOBS = {"verify": _verify, "gating-cli": _gating_cli, "load": _load_cli, "kld": _kld_cli}


def _job(path: Path, name: str) -> tuple[str, str]:
    """The unit of work behind a check: the in-process checks of a model share one child."""
    return (str(path), "worker" if name in WORKER_CHECKS else name)


def _run_job(path: Path, job: str) -> dict[str, tuple[bool, str]]:
    if job == "worker":
        return {c: (r["ok"], r["detail"]) for c, r in _worker_results(path).items()}
    return {job: _CLI_JOBS[job](path)}


class SweepPool:
    """Runs the children of the collected sweep tests `jobs` at a time, in the tests' order, so the
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
    return _file(entry, fn.variant), spec.params.get("variant_check", fn.check)


@pytest.fixture(scope="session")
def sweep(request: pytest.FixtureRequest, arch_manifest: dict) -> Iterator[SweepPool]:
    wanted = [w for w in map(_wanted, request.session.items) if w is not None]
    if any(path.parent == WSCALE_DIR for path, _ in wanted):
        _write_weight_scale_copies(arch_manifest)
    pool = SweepPool(wanted, int(os.environ.get("EDGEMOE_SWEEP_JOBS", os.cpu_count() or 2)))
    yield pool
    pool.close()


# --------------------------------------------------------------------------- the sweep


def test_models_generated(arch_manifest: dict) -> None:
    """test-llama-archs wrote a model for every architecture it does not skip itself, and some are MoE."""
    failed = [f"{e['arch']}: {e['detail']}" for e in arch_manifest["archs"] if e["status"] == "failed"]
    assert arch_models.moe_entries(arch_manifest), "no MoE models"
    assert not failed, "\n".join(failed)


def _assert(sweep: SweepPool, entry: dict, variant: str, name: str) -> None:
    ok, detail = sweep.result(_file(entry, variant), name)
    assert ok, detail


@check("generate")
def test_generate_equals_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "generate")


@check("verify")
def test_verify_passes(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "verify")


@check("gating-cli")
def test_gating_cli_runs(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "gating-cli")


@check("kld")
def test_perplexity_kl_divergence(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "kld")


@check("gating-top1")
def test_gating_top1_equals_stock_k1(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "gating-top1")


@check("cache")
def test_expert_cache_equals_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache")


@check("cache-static")
def test_static_cache_calibrated_on_first_use_equals_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache-static")


@check("cache-daop")
def test_native_daop_cache_calibrated_on_first_use_equals_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache-daop")


@check("cache-dali")
def test_native_dali_cache_equals_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache-dali")


@check("cache-precalc")
def test_precalc_runs_and_leaves_the_prompt_alone(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache-precalc")


@check("cache-borrow")
def test_prefill_buffers_borrowing_the_slots_equal_stock(sweep: SweepPool, entry: dict) -> None:
    _assert(sweep, entry, "", "cache-borrow")


@check("k1", variant="k1")
def test_one_expert_per_token(sweep: SweepPool, entry: dict, variant_check: str) -> None:
    """The copies with expert_used_count 1: the router picks one of the two experts."""
    _assert(sweep, entry, "k1", variant_check)


@check("scaled", variant="scaled")
def test_with_optional_expert_scales(sweep: SweepPool, entry: dict, variant_check: str) -> None:
    """The files with the per-expert ffn_*_exps.scale tensors test-llama-archs writes."""
    _assert(sweep, entry, "scaled", variant_check)


@check("wscale", variant="wscale")
def test_with_expert_weights_normalised_and_scaled(sweep: SweepPool, entry: dict, variant_check: str) -> None:
    """Copies with expert_weights_norm on and expert_weights_scale 2.5 (scale-applies: their stock logits
    differ from the unscaled file's, so the scale is read and the other checks see it)."""
    _assert(sweep, entry, "wscale", variant_check)


@check("load", variant="raw")
def test_files_as_llama_cpp_wrote_them_load(sweep: SweepPool, entry: dict) -> None:
    """edgemoe loads what llama.cpp's own model saver writes: every hyper-parameter, the unread ones 0."""
    _assert(sweep, entry, "raw", "load")
