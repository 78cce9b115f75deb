#!/usr/bin/env python3
"""Random-weight GGUFs of every MoE architecture the patched llama.cpp builds, for tests/test_arch_sweep.py.

llama.cpp's own tests/test-llama-archs.cpp makes a small random model of every architecture it
supports (2 layers, n_embd 256, a 128-token test vocabulary; MoE layers with 2 experts, both used)
and, given `-o DIR`, saves them as GGUF. This tool

1. builds that one executable from the patched vendored tree that `make install` unpacked
   (.build/src/<sdist>/vendor/llama.cpp) in a CMake build directory of its own
   (.build/cmake-archs: CPU only, static libraries, no server/tools/examples);
2. runs it once per architecture named in llama.cpp's src/llama-arch.cpp (an abort costs that
   architecture only) and keeps the models whose tensors hold routed experts (`ffn_*_exps`):
   <arch>.gguf without two things ordinary GGUFs do not have (the optional per-expert scale
   tensors and the 0.0 norm epsilon the architecture does not read; see rewrite_gguf), the same
   with expert_used_count 1 as <arch>.k1.gguf, and for a few architectures <arch>.scaled.gguf with
   the scales and <arch>.raw.gguf as written;
3. writes manifest.json beside them: for every architecture its files, n_expert, k and routing
   keys, or why there is no MoE file.

test-llama-archs gives every MoE model 2 experts and routes to both (experts used == expert
count); the .k1 copies route to one of the two. No model has a single expert.

A stamp (the patched source's identity, build options, seed, stdev) makes a second run do nothing.
Usage: tools/arch_models.py [--out DIR] [--jobs N] [--force]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_llama import NO_AMX_FLAGS, ROOT, SDIST_NAME, SDIST_SHA256, STAMP_NAME, BuildError, read_series  # noqa: E402

sys.path.insert(0, str(ROOT))  # this checkout's edgemoe, installed or not

LLAMA_SRC = ROOT / ".build" / "src" / SDIST_NAME / "vendor" / "llama.cpp"
BUILD_DIR = ROOT / ".build" / "cmake-archs"
DEFAULT_OUT = ROOT / ".build" / "arch-models"
TARGET = "test-llama-archs"
MANIFEST = "manifest.json"
BUILD_STAMP = ".edgemoe-archs-stamp.json"
FORMAT = 5  # bump when the manifest's contents change meaning
SEED = 1234
STDEV = 0.1  # test-llama-archs' default
GEN_TIMEOUT_S = 120

# Only the one test target, on the CPU backend: the models are written from random weights, no
# accelerator is involved. Static libraries keep the executable independent of the installed ones.
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=ON",
    "-DLLAMA_TESTS_INSTALL=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_SUBPROCESS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_RPC=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_CCACHE=OFF",
    # as tools/build_llama.py: ggml's AMX path segfaults on our CI machines
    "-DCMAKE_C_FLAGS=" + NO_AMX_FLAGS,
    "-DCMAKE_CXX_FLAGS=" + NO_AMX_FLAGS,
]

_ARCH_NAME_RE = re.compile(r'\{\s*LLM_ARCH_(\w+)\s*,\s*"([^"]+)"\s*\}')
_UNSUPPORTED_RE = re.compile(r"(\S+) model \((MoE|dense)\) is unsupported, skipping")


def log(msg: str) -> None:
    print(f"[arch-models] {msg}", flush=True)


@dataclass
class ArchEntry:
    """One architecture: its MoE file (relative to the output dir) or why there is none."""

    arch: str
    status: str  # "moe": a MoE file; "dense": only a dense model; "skipped": none written; "failed"
    file: str | None = None  # the MoE model, without what rewrite_gguf leaves out
    scaled_file: str | None = None  # the same with the optional per-expert scales (KEEP_SCALED only)
    raw_file: str | None = None  # as test-llama-archs wrote it (KEEP_SCALED only)
    k1_file: str | None = None  # file with expert_used_count 1: each token routed to one of the experts
    keys_removed: list[str] = field(default_factory=list)  # from file and scaled_file
    tensors_removed: list[str] = field(default_factory=list)  # from file
    detail: str = ""
    seconds: float = 0.0
    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    n_layer: int = 0
    moe_layers: list[int] = field(default_factory=list)
    expert_tensors: list[str] = field(default_factory=list)  # stacked expert weights, first MoE layer
    other_expert_tensors: list[str] = field(default_factory=list)  # its other *_exps tensors (biases...)
    # routing keys as the file has them (None: absent); an architecture may not read them
    gating_func: int | None = None
    expert_weights_norm: bool | None = None
    expert_weights_scale: float | None = None
    edgemoe_error: str = ""  # edgemoe's header reading failed or disagrees (the file is still swept)


# --------------------------------------------------------------------------- source and build


def source_identity(venv: Path) -> dict[str, str]:
    """What .build/src holds: the sdist and patches the last `make install` built (its stamp in the venv).

    Without that stamp, the pinned sdist and this checkout's patches/. A checkout whose patches/ differ
    from what was built is warned about, not refused: .build/src is what the installed library runs.
    """
    if not (LLAMA_SRC / "tests" / f"{TARGET}.cpp").exists():
        raise BuildError(f"{LLAMA_SRC}/tests/{TARGET}.cpp is missing: run `make install` first (it unpacks "
                         "and patches the vendored llama.cpp under .build/src)")
    h = hashlib.sha256()
    for p in read_series(ROOT / "patches"):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    ours = {"sdist_sha256": SDIST_SHA256, "patches_sha256": h.hexdigest()}
    stamp = venv / STAMP_NAME
    if not stamp.exists():
        log(f"warning: no {stamp}: assuming .build/src holds this checkout's patches/")
        return ours
    built = json.loads(stamp.read_text())
    ident = {k: str(built.get(k)) for k in ("sdist_sha256", "patches_sha256")}
    if ident != ours:
        log("warning: this checkout's patches/ differ from what the last `make install` built; the models "
            "come from .build/src as it is (run `make install` to rebuild it from patches/)")
    return ident


def cmake_command(build_dir: Path) -> list[str]:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # real paths: a worktree's .build is a link to the main checkout's, and CMake refuses a cache made
    # through another path to the same directory
    return ["cmake", "-S", str(LLAMA_SRC.resolve()), "-B", str(build_dir.resolve()), *gen, *CMAKE_ARGS]


def _cache_elsewhere(build_dir: Path) -> bool:
    """Was build_dir's CMakeCache.txt made for another directory (through another path)?"""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return False
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_CACHEFILE_DIR:INTERNAL="):
            return line.split("=", 1)[1] != str(build_dir.resolve())
    return False


def build_exe(ident: dict[str, str], jobs: int, force: bool = False, build_dir: Path = BUILD_DIR) -> Path:
    """The test-llama-archs executable, built unless the stamp says it is up to date."""
    exe = build_dir / "bin" / TARGET
    key = {"source": ident, "cmake_args": CMAKE_ARGS}
    stamp = build_dir / BUILD_STAMP
    if not force and exe.exists() and stamp.exists() and json.loads(stamp.read_text()) == key:
        return exe
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not on PATH; install it (and a C++17 compiler) to build " + TARGET)
    old = json.loads(stamp.read_text()) if stamp.exists() else None
    if (force or (old is not None and old.get("cmake_args") != CMAKE_ARGS)  # new options: a fresh configure
            or _cache_elsewhere(build_dir)):
        shutil.rmtree(build_dir, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    logfile = build_dir.parent / "cmake-archs.log"
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    t0 = time.time()
    log(f"building {TARGET} from {LLAMA_SRC.relative_to(ROOT)} in {build_dir.relative_to(ROOT)} "
        f"({jobs} jobs; log: {logfile.relative_to(ROOT)})")
    with logfile.open("w") as f:
        for cmd in (cmake_command(build_dir),
                    ["cmake", "--build", str(build_dir), "--target", TARGET, "-j", str(jobs)]):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            if proc.returncode != 0:
                tail = "\n".join(logfile.read_text().splitlines()[-25:])
                raise BuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}); last lines of "
                                 f"{logfile}:\n{tail}")
    if not exe.exists():
        raise BuildError(f"the build finished but {exe} does not exist; see {logfile}")
    log(f"built {TARGET} in {time.time() - t0:.0f} s")
    stamp.write_text(json.dumps(key, indent=1))
    return exe


# --------------------------------------------------------------------------- models


def arch_names() -> list[str]:
    """Every architecture name in llama.cpp's LLM_ARCH_NAMES table, in its order."""
    text = (LLAMA_SRC / "src" / "llama-arch.cpp").read_text()
    start = text.find("LLM_ARCH_NAMES")
    end = text.find("};", start)
    names = [m.group(2) for m in _ARCH_NAME_RE.finditer(text[start:end]) if m.group(1) != "UNKNOWN"]
    if not names:
        raise BuildError(f"found no LLM_ARCH_NAMES table in {LLAMA_SRC}/src/llama-arch.cpp")
    return names


_EXPERT_WEIGHT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate_up|gate|up|down)_exps)\.weight$")


def describe(path: Path) -> dict[str, object]:
    """What the sweep needs from a file: expert counts, MoE layers, routing keys.

    Read with gguf-py, independent of edgemoe, so a file edgemoe cannot read stays in the sweep and
    fails there; edgemoe's own reading (read_model_info) is tried too and its error recorded.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))

    def kv(key: str) -> object:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = str(kv("general.architecture"))
    layers: dict[int, list[str]] = {}
    n_stacked = 0  # the experts dimension of the stacked weights (ggml order: the last)
    for t in reader.tensors:
        m = _EXPERT_WEIGHT_RE.match(t.name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(m.group(2))
            n_stacked = int(t.shape[-1])
    moe_layers = sorted(layers)
    first = moe_layers[0] if moe_layers else None
    extra = sorted(t.name.split(".", 2)[2] for t in reader.tensors
                   if first is not None and t.name.startswith(f"blk.{first}.") and "_exps" in t.name
                   and not _EXPERT_WEIGHT_RE.match(t.name))

    def num(key: str, kind: type) -> object:
        v = kv(f"{arch}.{key}")
        return None if v is None else kind(v)

    try:
        from edgemoe.gguf.info import read_model_info

        info = read_model_info(path)
        edgemoe_error = "" if info.n_expert == num("expert_count", int) else (
            f"edgemoe reads n_expert {info.n_expert}, the file says {num('expert_count', int)}")
    except Exception as err:  # noqa: BLE001 - recorded; the sweep's tests fail on it
        edgemoe_error = f"edgemoe.gguf.info.read_model_info: {type(err).__name__}: {err}"
    return dict(n_expert=(num("expert_count", int) or n_stacked) if moe_layers else 0,
                n_expert_used=num("expert_used_count", int) or 0,
                n_expert_shared=num("expert_shared_count", int) or 0, n_layer=num("block_count", int) or 0,
                moe_layers=moe_layers, expert_tensors=sorted(layers[first]) if first is not None else [],
                other_expert_tensors=extra, gating_func=num("expert_gating_func", int),
                expert_weights_norm=num("expert_weights_norm", bool),
                expert_weights_scale=num("expert_weights_scale", float), edgemoe_error=edgemoe_error)


# Two things in the files as test-llama-archs writes them (llama_model_saver writes every tensor the
# loader created and every hyper-parameter) that ordinary converted GGUFs do not have:
# - the optional per-expert scale tensors llama.cpp's loader creates for every MoE architecture
#   (NVFP4/ModelOpt-style checkpoints): ffn_*_exps.scale multiplies each expert's output, gathered with
#   the routed ids; ffn_*_exps.input_scale is loaded but unused;
# - the norm epsilon the architecture does not read, written as 0.0 (test-llama-archs sets both to
#   1e-5, so a 0.0 in the file is one the architecture never read).
# <arch>.gguf has neither; <arch>.scaled.gguf keeps the scales, for the architectures in KEEP_SCALED
# (one per expert-tensor layout), and <arch>.raw.gguf is the file as written, for the same ones.
_OPTIONAL_EXPERT_SCALE_RE = re.compile(r"^blk\.\d+\.ffn_(?:gate_up|gate|up|down)_exps\.(?:input_)?scale$")
_NORM_EPS_RE = re.compile(r"^[^.]+\.attention\.layer_norm(?:_rms)?_epsilon$")
# separate gate/up experts; merged gate_up; expert biases and softmax weights
KEEP_SCALED = ("qwen3moe", "qwen35moe", "gpt-oss")


def _unread_norm_eps(name: str, value: object) -> bool:
    return bool(_NORM_EPS_RE.match(name)) and value == 0.0


def rewrite_gguf(src: Path, dst: Path, *, scales: bool, k: int | None = None,
                 values: dict[str, float | bool] | None = None) -> tuple[list[str], list[str]]:
    """Copy src to dst without the unread norm epsilons and, unless scales, the optional per-expert
    scale tensors, with expert_used_count k if given and the scalar float32/bool keys in `values`
    ("<arch>." left out of their names) set; (the keys left out, the tensors left out).

    Byte-level: the header and the other metadata are copied as written (gguf-py's writer refuses the
    empty arrays these files hold), the kept tensor infos get new contiguous offsets, the data is
    laid out again.
    """
    import gguf

    reader = gguf.GGUFReader(str(src))
    raw = np.memmap(src, dtype=np.uint8, mode="r")
    align = reader.alignment

    def span(rf: gguf.ReaderField) -> bytes:
        return raw[rf.offset:rf.offset + sum(int(p.nbytes) for p in rf.parts)].tobytes()

    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    dropped_keys = [f.name for f in fields
                    if len(f.types) == 1 and _unread_norm_eps(f.name, f.contents())]
    kept_fields = [f for f in fields if f.name not in dropped_keys]
    kept = [t for t in reader.tensors if scales or not _OPTIONAL_EXPERT_SCALE_RE.match(t.name)]
    dropped_tensors = sorted({t.name for t in reader.tensors} - {t.name for t in kept})
    used_key = f"{reader.fields['general.architecture'].contents()}.expert_used_count"
    if k is not None and reader.fields[used_key].types != [gguf.GGUFValueType.UINT32]:
        raise BuildError(f"{src.name}: {used_key} is not one uint32, cannot set k={k}")
    arch = reader.fields["general.architecture"].contents()
    packed: dict[str, bytes] = {}  # full key -> the value's bytes, which end the key's span
    for name, value in (values or {}).items():
        rf = reader.fields.get(f"{arch}.{name}")
        fmt = {gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?"}.get(
            rf.types[0] if rf is not None and len(rf.types) == 1 else None)
        if fmt is None:
            raise BuildError(f"{src.name}: {arch}.{name} is not one float32 or bool, cannot set it to {value}")
        packed[f"{arch}.{name}"] = struct.pack(fmt, value)
    if k is not None:
        packed[used_key] = struct.pack("<I", k)
    first_kv = min(f.offset for f in fields)
    header = bytearray(raw[:first_kv])  # magic, version, tensor count, kv count
    header[8:24] = struct.pack("<QQ", len(kept), len(kept_fields))
    infos, offset = bytearray(), 0
    for t in kept:
        info = bytearray(span(t.field))
        info[-8:] = struct.pack("<Q", offset)  # each tensor info ends with its data offset
        infos += info
        offset += -(-int(t.n_bytes) // align) * align
    with dst.open("wb") as f:
        f.write(header)
        for kv in kept_fields:
            data = span(kv)
            new = packed.get(kv.name)
            f.write(data if new is None else data[:-len(new)] + new)
        f.write(infos)
        f.write(b"\0" * (-f.tell() % align))
        for t in kept:
            f.write(raw[t.data_offset:t.data_offset + int(t.n_bytes)].tobytes())
            f.write(b"\0" * (-int(t.n_bytes) % align))
    return dropped_keys, dropped_tensors


def generate_one(exe: Path, arch: str, tmp: Path, seed: int, stdev: float) -> ArchEntry:
    """Run test-llama-archs for one architecture into tmp/<arch>/; classify what it wrote."""
    work = tmp / arch
    work.mkdir(parents=True)
    t0 = time.time()
    try:
        proc = subprocess.run([str(exe), "-a", arch, "-o", str(work), "-s", str(seed), "-d", str(stdev)],
                              capture_output=True, text=True, timeout=GEN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ArchEntry(arch, "failed", detail=f"test-llama-archs ran past {GEN_TIMEOUT_S} s",
                         seconds=time.time() - t0)
    seconds = time.time() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower() or "abort" in ln.lower()),
                   lines[-1] if lines else "")
        return ArchEntry(arch, "failed", detail=f"test-llama-archs exit {proc.returncode}: {why.strip()}",
                         seconds=seconds)
    files = sorted(work.glob("*.gguf"))
    unsupported = [f"{m.group(2)}" for m in _UNSUPPORTED_RE.finditer(out)]
    entries = []
    for f in files:
        try:
            d = describe(f)
        except Exception as err:  # noqa: BLE001 - any unreadable file is this architecture's failure
            return ArchEntry(arch, "failed", detail=f"{f.name}: gguf-py cannot read it: {err}",
                             seconds=seconds)
        entries.append((f, d))
    moe = [(f, d) for f, d in entries if d["n_expert"]]
    if len(moe) > 1:
        return ArchEntry(arch, "failed", detail=f"several MoE files: {[f.name for f, _ in moe]}",
                         seconds=seconds)
    if moe:
        f, d = moe[0]
        return ArchEntry(arch, "moe", file=f.name, seconds=seconds, **d)  # type: ignore[arg-type]
    if entries:
        return ArchEntry(arch, "dense", detail="test-llama-archs writes only a dense model", seconds=seconds)
    why = ("test-llama-archs: unsupported (" + ", ".join(unsupported) + ")" if unsupported
           else "test-llama-archs writes no model of it (its arch_supported(), model saver or own skip list)")
    return ArchEntry(arch, "skipped", detail=why, seconds=seconds)


def models_key(ident: dict[str, str], seed: int, stdev: float) -> dict[str, object]:
    return {"format": FORMAT, "source": ident, "cmake_args": CMAKE_ARGS, "seed": seed, "stdev": stdev}


def load_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def up_to_date(out: Path, key: dict[str, object]) -> dict | None:
    """The manifest if out/ holds every file it lists for this key, else None."""
    m = load_manifest(out)
    if m is None or m.get("key") != key:
        return None
    files = [e[k] for e in m["archs"] for k in ("file", "scaled_file", "raw_file", "k1_file") if e[k]]
    if not all((out / f).exists() for f in files):
        return None
    return m


def generate(exe: Path, out: Path, key: dict[str, object], jobs: int, seed: int, stdev: float) -> dict:
    names = arch_names()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(f"writing random models of {len(names)} architectures to {out} ({jobs} at a time)")
    t0 = time.time()
    width = len(str(len(names)))
    results: list[ArchEntry] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(generate_one, exe, a, tmp, seed, stdev) for a in names]
        for i, fut in enumerate(futures, 1):
            e = fut.result()
            results.append(e)
            what = {"moe": f"MoE: {e.n_expert} experts, k={e.n_expert_used}, MoE layers {e.moe_layers}",
                    "dense": "dense only", "skipped": f"skipped: {e.detail}",
                    "failed": f"FAILED: {e.detail}"}[e.status]
            if e.edgemoe_error:
                what += f" [{e.edgemoe_error}]"
            log(f"{i:>{width}}/{len(names)} {e.arch:<18} {what} ({e.seconds:.1f} s)")
    final = out.with_name(out.name + ".new")
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir()
    for e in results:
        if e.file:
            written = tmp / e.arch / e.file
            e.file = f"{e.arch}.gguf"
            e.keys_removed, e.tensors_removed = rewrite_gguf(written, final / e.file, scales=False)
            if e.n_expert_used > 1:
                e.k1_file = f"{e.arch}.k1.gguf"
                rewrite_gguf(written, final / e.k1_file, scales=False, k=1)
            if e.arch in KEEP_SCALED:
                e.scaled_file, e.raw_file = f"{e.arch}.scaled.gguf", f"{e.arch}.raw.gguf"
                rewrite_gguf(written, final / e.scaled_file, scales=True)
                shutil.move(str(written), final / e.raw_file)
    manifest = {"key": key, "seconds": round(time.time() - t0, 1), "archs": [asdict(e) for e in results]}
    (final / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    final.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    n_moe = sum(e.status == "moe" for e in results)
    n_failed = sum(e.status == "failed" for e in results)
    log(f"{n_moe} MoE models in {out} ({n_failed} architectures failed) in {manifest['seconds']:.0f} s")
    return manifest


def ensure(out: Path = DEFAULT_OUT, *, jobs: int | None = None, force: bool = False, seed: int = SEED,
           stdev: float = STDEV, venv: Path | None = None) -> dict:
    """Build and generate as needed; the manifest ({"key", "seconds", "archs": [ArchEntry as dict]})."""
    jobs = jobs or os.cpu_count() or 2
    ident = source_identity(venv or Path(sys.prefix))
    key = models_key(ident, seed, stdev)
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time: test sessions of several checkouts share .build (a worktree links it)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force:
            m = up_to_date(out, key)
            if m is not None:
                log(f"up to date: {len(moe_entries(m))} MoE models in {out}")
                return m
        exe = build_exe(ident, jobs, force)
        return generate(exe, out, key, jobs, seed, stdev)


def moe_entries(manifest: dict) -> list[dict]:
    return [e for e in manifest["archs"] if e["status"] == "moe"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", "-j", type=int, default=None, help="build and generation jobs (default: CPUs)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--stdev", type=float, default=STDEV)
    ap.add_argument("--force", action="store_true", help="rebuild and regenerate even if up to date")
    ap.add_argument("--venv", type=Path, default=None,
                    help="the venv `make install` built into (default: this Python's)")
    ap.add_argument("--list", action="store_true", help="print the manifest's table after generating")
    args = ap.parse_args(argv)
    try:
        m = ensure(args.out.resolve(), jobs=args.jobs, force=args.force, seed=args.seed, stdev=args.stdev,
                   venv=args.venv)
    except BuildError as err:
        print(f"[arch-models] error: {err}", file=sys.stderr)
        return 1
    if args.list:
        for e in m["archs"]:
            extra = (f"n_expert={e['n_expert']} k={e['n_expert_used']} shared={e['n_expert_shared']} "
                     f"gating_func={e['gating_func']} norm={e['expert_weights_norm']} "
                     f"scale={e['expert_weights_scale']} tensors={','.join(e['expert_tensors'])}"
                     if e["status"] == "moe" else e["detail"])
            print(f"{e['arch']:<18} {e['status']:<8} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
