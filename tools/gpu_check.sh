#!/usr/bin/env bash
# GPU checks of edgemoe on a CUDA machine with no network (the GPU machine we borrow), in steps:
#
#   python3 tools/device_pack.py        # here, with network: fills .devcarry/ (trimmed sdist, wheels)
#   bash tools/gpu_check.sh build       # there: wheels + CUDA build of the patched llama.cpp + edgemoe
#   bash tools/gpu_check.sh doctor      # there, after build: `edgemoe doctor` (text and JSON), each step in a child
#   bash tools/gpu_check.sh test        # there: the GPU tests, then the suite against the CUDA build
#   bash tools/gpu_check.sh bench       # there: edgemoe bench on the full-depth synthetic qwen3-30b-a3b
#   bash tools/gpu_check.sh all         # build, doctor, test, bench in a row
#   bash tools/gpu_check.sh diag        # there, after build: stock Llama and Engine loads on CUDA case by
#                                       # case, then a native backtrace (cuda-gdb) of the last case
#
# On a CUDA machine with network the same is `make install EDGEMOE_CUDA=1 EDGEMOE_CUDA_ARCH=90 &&
# make test PYTEST_ARGS='-m gpu'`. Logs and JSON go to $OUT (the device tool's) or out/gpu.
# Environment: PYTHON (default python3, whose environment receives the build), CUDA_ARCH (default 90),
# BENCH_VRAM (default 8GiB), BENCH_MODEL (default: written under /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-$PWD/out/gpu}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.devcarry/wheels" PYTHONUNBUFFERED=1

step_build() {
    local t0=$SECONDS
    "$PY" -m pip install -q --no-deps .devcarry/wheels/*.whl || return 1
    EDGEMOE_SDIST="$PWD/.devcarry/llama_cpp_python-0.3.36-trimmed.tar.gz" \
        "$PY" tools/build_llama.py --venv "$PREFIX" --cuda --cuda-arch "${CUDA_ARCH:-90}" \
        --cmake-args "-DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF"
    local rc=$?
    cp .build/build-cuda.log "$OUTDIR/build-cuda.log" 2>/dev/null
    [ $rc -eq 0 ] || return $rc
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
    echo "build: $((SECONDS - t0)) s"
}

step_doctor() {
    # first after the build: what the machine and build are, and which load step fails (never fatal: each step
    # runs in a child process with a timeout)
    timeout 900 "$PY" -m edgemoe.cli doctor --json > "$OUTDIR/doctor.json" 2> "$OUTDIR/doctor.err"
    local rc=$?
    "$PY" - "$OUTDIR/doctor.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for s in r["steps"]:
    print("ok  " if s["ok"] else "FAIL", s["name"], s["error"] or s["data"].get("tokens", ""))
print("first failure:", r["first_failure"])
EOF
    return $rc
}

step_test() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/test_serve.py --junitxml="$OUTDIR/gpu-tests.xml" tests 2>&1 | tee "$OUTDIR/gpu-tests.log"
    # the CPU suite against the CUDA build: everything must still pass with a GPU present
    timeout 420 "$PY" -m pytest -q -m "not slow and not gpu" -p no:cacheprovider -x --ignore=tests/test_serve.py \
        tests 2>&1 | tail -n 40 | tee "$OUTDIR/suite.log"
}

step_bench() {
    local model=${BENCH_MODEL:-/tmp/qwen3-30b-a3b.Q4_K.gguf}
    local t0=$SECONDS
    [ -f "$model" ] || "$PY" tools/synth_gguf.py qwen3-30b-a3b --out "$model" --quiet || return 1
    echo "synthetic model: $((SECONDS - t0)) s"
    # this machine's profile (commit it as the measured H100 profile): bench's projections and --assign's costs
    "$PY" -m edgemoe.cli profile --out "$OUTDIR/profile.json" > "$OUTDIR/profile.txt" 2>&1 || return 1
    "$PY" -m edgemoe.cli bench "$model" --vram "${BENCH_VRAM:-8GiB}" --policy lru --compare-overlap \
        --profile "$OUTDIR/profile.json" --assign ratio --device-prefill 32 --precalc-from 30 --json > "$OUTDIR/bench.json" 2> "$OUTDIR/bench.err"
    local rc=$?
    tail -n 5 "$OUTDIR/bench.err"
    "$PY" - "$OUTDIR/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["device"], "vram", r["vram"], "threads", r["threads"], "slots/layer", r["slots_per_layer"])
for row in r["rows"]:
    print(f'{row["name"]:28} prefill {row["prefill_tps"]:8.1f}  decode {row["decode_tps"]:7.2f}  '
          f'ratio decode {row["ratio_decode"]}  prefill {row["ratio_prefill"]}')
EOF
    return $rc
}

step_diag() {
    local model
    model=$(ls models/*.gguf | head -n 1)
    # stock Llama alone, then after edgemoe's import (its abort callback), then with edgemoe's log callback:
    # which of edgemoe's process-wide settings, if any, turns stock's working load into the crash
    cat > /tmp/edgemoe_diag_stock.py <<EOF
import faulthandler, sys
faulthandler.enable()
if sys.argv[1] != "alone":
    from edgemoe.runtime import native
    if sys.argv[1] == "log":
        native.route_logs_to_python()
import llama_cpp
llm = llama_cpp.Llama("$model", n_ctx=256, n_gpu_layers=int(sys.argv[2]), verbose=False)
print("ok stock", sys.argv[1:], llm("hi", max_tokens=4, temperature=0)["choices"][0]["text"], flush=True)
EOF
    for args in "alone 999" "import 999" "log 999"; do
        echo "== stock Llama, edgemoe=${args% *}, n_gpu_layers=${args#* }"
        timeout 120 "$PY" /tmp/edgemoe_diag_stock.py $args 2>&1 | grep -v "site-packages" | tail -n 8
    done
    cat > /tmp/edgemoe_diag.py <<EOF
import faulthandler, sys
faulthandler.enable()
from edgemoe.runtime import native
if sys.argv[1] == "nolog":
    native.route_logs_to_python = lambda: None
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY
with Engine("$model", LoadConfig(n_ctx=256, n_gpu_layers=int(sys.argv[2]))) as eng:
    print("ok", sys.argv[1:], eng.generate("hi", max_tokens=4, sampling=GREEDY).tokens, flush=True)
EOF
    for args in "log 0" "nolog 0" "nolog 999" "log 999"; do
        echo "== Engine, logs=${args% *}, n_gpu_layers=${args#* }"
        timeout 120 "$PY" /tmp/edgemoe_diag.py $args 2>&1 | grep -v "site-packages" | tail -n 8
    done
    echo "== native backtrace of the last case"
    timeout 240 cuda-gdb -batch -ex run -ex bt --args "$PY" /tmp/edgemoe_diag.py log 999 2>&1 \
        | grep -v "^\[New Thread\|^\[Thread" | tail -n 40
}

case "${1:-all}" in
    build) step_build ;;
    doctor) step_doctor ;;
    test) step_test ;;
    bench) step_bench ;;
    diag) step_diag ;;
    all) step_build && { step_doctor; step_test; step_bench; } ;;
    *) echo "usage: $0 build|doctor|test|bench|diag|all" >&2; exit 2 ;;
esac
