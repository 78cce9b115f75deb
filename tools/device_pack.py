#!/usr/bin/env python3
"""Pack what an offline GPU machine needs to build and test edgemoe into ``.devcarry/``.

The GPU machine we borrow reaches no package registry and takes at most 64 MiB of files with
each command. This writes, into the git-ignored ``.devcarry/``:

* ``llama_cpp_python-0.3.36-trimmed.tar.gz``: the pinned sdist (verified by its sha256) without
  llama.cpp's bundled vocab models, docs, web UI, benchmarks, git metadata and the backends we
  never build (Vulkan, SYCL, Metal, ...). A marker file inside records the sha256 of the sdist it
  came from; ``tools/build_llama.py`` accepts such a tarball (``EDGEMOE_SDIST=...``) only when
  the marker names the pinned sdist.
* ``wheels/``: the pure-Python packages edgemoe needs that the GPU machine's image lacks.

Then, on the GPU machine: ``bash tools/gpu_check.sh`` (see that script).
"""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_llama import ROOT, SDIST_NAME, SDIST_SHA256, TRIM_MARKER, fetch_sdist  # noqa: E402

OUT = ROOT / ".devcarry"
# pure-Python wheels missing from the GPU machine's image (its torch/numpy/click/tqdm are used)
WHEELS = ["gguf==0.19.0", "diskcache==5.6.3"]
_LLAMA = f"{SDIST_NAME}/vendor/llama.cpp/"
_SKIP_DIRS = ["models/", "docs/", "tools/ui/", "tools/server/", "benches/", "media/",
              "tests/snapshots/", ".github/", "examples/", "gguf-py/"]
_SKIP_BACKENDS = ["cann", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "sycl", "virtgpu",
                  "vulkan", "webgpu", "zdnn", "zendnn", "et"]


def keep(name: str) -> bool:
    """Whether a member of the sdist is needed for a CUDA/CPU build."""
    if "/.git/" in name or name.endswith("/.git"):
        return False
    if not name.startswith(_LLAMA):
        return True
    rel = name[len(_LLAMA):]
    if any(rel.startswith(d) for d in _SKIP_DIRS):
        return False
    return not any(rel.startswith(f"ggml/src/ggml-{b}/") for b in _SKIP_BACKENDS)


def trim_sdist(src: Path, dst: Path) -> tuple[int, int]:
    """Copy src to dst without the members keep() rejects, plus the marker; (kept, dropped)."""
    kept = dropped = 0
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz", compresslevel=6) as tout:
        for m in tin:
            if not keep(m.name):
                dropped += 1
                continue
            kept += 1
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
        data = (SDIST_SHA256 + "\n").encode()
        info = tarfile.TarInfo(f"{SDIST_NAME}/{TRIM_MARKER}")
        info.size = len(data)
        tout.addfile(info, io.BytesIO(data))
    return kept, dropped


def download_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "py", "--platform", "any", "-d", str(dest), *WHEELS]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit("pip could not download the wheels; check the network/PyPI")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tarball = fetch_sdist(ROOT / ".build" / "sdist", sys.executable)
    dst = args.out / f"{SDIST_NAME}-trimmed.tar.gz"
    kept, dropped = trim_sdist(tarball, dst)
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB; {kept} files kept, {dropped} left out)")
    download_wheels(args.out / "wheels")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f".devcarry holds {total / 2**20:.1f} MiB (the device takes 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
