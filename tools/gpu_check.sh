#!/usr/bin/env bash
# The whole GPU check of edgemoe in one lent call (a CUDA machine with no network, 16 cores, 10 minutes a
# command, at most 8 files back from $OUT):
#
#   python3 tools/device_pack.py        # here, with network: fills .devcarry/ (trimmed sdist, wheels)
#   bash tools/gpu_check.sh all         # there: build, then every check below; under 540 s on paper
#   bash tools/gpu_check.sh warm        # there, on a warm machine: the same without the build when .build/ and
#                                       # the installed stamp are there from the last call, plus the 8K-token
#                                       # prefill rows (step prefill) and the 32K-context rows (step ctx), which
#                                       # `all` has no time left for
#   bash tools/gpu_check.sh ids         # there, warm: the op cases, then lru at 8 GiB in both id-row modes
#                                       # (raw, fill) with CUDA graphs on and off, stock beside each (step ids),
#                                       # and decode after a 16K-token prompt for stock and lru (step depth)
#   bash tools/gpu_check.sh dry-run     # anywhere (CI: tests/test_gpu_check.py): every step with CPU stand-ins
#   bash tools/gpu_check.sh build|ops|doctor|tests|bench|prefill|ctx|depth|profile|diag    # one step alone
#   GPU_CHECK_WORK=/tmp/gpu-check.X bash tools/gpu_check.sh pack      # a run's logs into $OUT again
#
# Time budget of `all` on a 16-core H100 (each cap is a `timeout`; a step past it is cut, the rest still run):
#
#   | step                                                            | cap s | basis                              |
#   | --------------------------------------------------------------- | ----- | ---------------------------------- |
#   | build: wheels, CUDA sm_90 build, test-backend-ops, edgemoe;     |   285 | 235 s and 263 s on two H100s, plus |
#   |   the synthetic qwen3-30b-a3b written in the background         |       | ~20 s for test-backend-ops         |
#   | wait for the synthetic model (if the build finished first)      |    15 |                                    |
#   | ops: test-backend-ops' series cases on CUDA0 (the id rows of    |    30 | 210 small cases: seconds on a GPU  |
#   |   every mul_mat_id path first), before anything could crash     |       |                                    |
#   | checks, in parallel: doctor (the device's id-row mode too);     |    75 | 26 tests on the tiny fixtures;     |
#   |   pytest -m gpu, one process per test, 8 at a time;            |       | each of the four has this cap      |
#   |   compute-sanitizer memcheck of one cache test; the synthetic   |       |                                    |
#   |   model's calibration (static, daop) for the bench              |       |                                    |
#   | bench at 8 GiB, 512-token prompt: stock, lru, static, daop,     |   110 | one process, five rows and four    |
#   |   then the best stock row and each policy with prompt lookup    |       | "+lookup" rows (acceptance, tok/step)|
#   | edgemoe profile                                                 |    30 | capped: did not finish in 120 s    |
#   | (warm, prefill only) 8K-token prefill at 8 GiB, -ub planned on  |   240 | four rows: a model load, an 8K     |
#   |   PREFILL_PROFILE: stock -ot exps=CPU and best --n-cpu-moe at   |       | prefill, a reuse TTFT each, and    |
#   |   stock's best -ub, edgemoe static, static + device prefill at  |       | their projections (not measured    |
#   |   edgemoe's planned -ub (bench's `ub` column)                   |       | yet: no GPU was lent since)        |
#   | (warm, ctx only) a 32K context at 8 GiB, f16 then q8_0 KV:      |   240 | two benches of five rows, each a   |
#   |   stock rows, edgemoe static and static +tiers (the context in  |       | model load and a 512-token prompt  |
#   |   steps)                                                        |       | (not measured yet)                 |
#   | tarball, summary                                                |     5 |                                    |
#   | total                                                           |   550 | at the 540 s a call may take: the  |
#   |                                                                 |       | profile (30) is the step cut first |
#
# `ids` (a warm call after `all`): ops (30), then four benches of stock's rows and lru at 8 GiB with a 512-token
# prompt, EDGEMOE_DEVICE_IDS=raw and =fill, each with CUDA graphs on and with GGML_CUDA_DISABLE_GRAPHS=1 (cap
# IDS_CAP, default 240: about 50 s each), then `depth`: stock and lru decoding 32 tokens after a 16K-token prompt
# (cap DEPTH_CAP, default 240). ids.json and depth.json come back.
#
# $OUT gets at most 8 files (the script checks): summary.txt (one line per step: status, seconds, cap),
# gpu-tests.txt (one line per GPU test), doctor.json, bench.json, prefill.json (warm, prefill, dry-run), ctx.json (warm, ctx, dry-run),
# profile.json (when the profile finished)
# and logs.tar.gz (every log: build, doctor, each test's output, test-backend-ops, compute-sanitizer,
# bench, profile). Without $OUT: out/gpu.
#
# Environment: PYTHON (default python3, whose environment receives the build), CUDA_ARCH (default 90),
# BENCH_VRAM (default 8GiB), BENCH_MODEL (default /tmp/qwen3-30b-a3b.Q4_K.gguf), TEST_JOBS (default 8),
# BENCH_EXTRA (more bench options, e.g. "--compare-overlap --device-prefill 32 --precalc-from 30": each adds rows
# and time, so give BENCH_CAP more seconds and run it as `bench` alone or in a `warm` call),
# PREFILL_PROFILE (default h100-server: the profile the prefill rows' -ub is planned on; a file or bundled name),
# PREFILL_CAP (default 240), CTX_CAP (default 240), GPU_CHECK_PRELOAD_LIBSTDCXX (default 1: LD_PRELOAD the system libstdc++.so.6 into everything after the
# build, the workaround for libggml-cuda's static C++ runtime, docs/build.md; set 0 once the link fix is in),
# GPU_CHECK_DRY=1 (the same as dry-run).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTDIR=${OUT:-$ROOT/out/gpu}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
LOGS=$WORK/logs
mkdir -p "$OUTDIR" "$LOGS"
PY=${PYTHON:-python3}
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
DRY=${GPU_CHECK_DRY:-0}
MODE=${1:-all}
[ "$MODE" = dry-run ] && DRY=1
MAX_OUT_FILES=8
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
    # stand-ins on the CPU: a tiny synthetic model written beside the stub build, the bench on the bundled
    # fixture (calibrated), short caps
    BENCH_MODEL=${BENCH_MODEL:-$ROOT/models/edgemoe-tiny-qwen3moe.Q4_K_M.gguf}
    SYNTH_OUT=$WORK/tiny-qwen3moe.gguf
    SYNTH_PRESET=tiny-qwen3moe
    BENCH_ARGS=(--prompt-tokens 32 --gen-tokens 4 -t 1)  # one thread: no spinning against a busy CI machine
    PREFILL_ARGS=(--prompt-tokens 64 --gen-tokens 2 --device-prefill 16 -t 1)
    CTX_ARGS=(--ctx 8192 --prompt-tokens 32 --gen-tokens 2 -t 1)
    CAP_CTX=60
    # a budget under which the fixture's 8192-token context leaves 8 slots per layer and its 4096 step more
    CTX_VRAM=$("$PY" -c 'import sys
from edgemoe.gguf.info import read_model_info
from edgemoe.plan.reserve import budget_for_slots
print(budget_for_slots(read_model_info(sys.argv[1]), 8, 8192))' "$BENCH_MODEL")
    IDS_ARGS=(--prompt-tokens 32 --gen-tokens 4 -t 1)
    DEPTH_ARGS=(--prompt-tokens 256 --gen-tokens 4 -t 1)
    CAP_BUILD=30 CAP_SYNTH=30 CAP_CHECKS=60 CAP_BENCH=45 CAP_PROFILE=3 CAP_PREFILL=60 CAP_OPS=30 CAP_IDS=120
    CAP_DEPTH=60
    SANITIZER=()
    OPS_BACKEND=CPU
else
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$ROOT/.devcarry/wheels"
    BENCH_MODEL=${BENCH_MODEL:-/tmp/qwen3-30b-a3b.Q4_K.gguf}
    SYNTH_OUT=$BENCH_MODEL
    SYNTH_PRESET=qwen3-30b-a3b
    BENCH_ARGS=(--prompt-tokens 512 --gen-tokens 32)
    PREFILL_ARGS=(--prompt-tokens 8192 --gen-tokens 2 --device-prefill 256)
    CTX_ARGS=(--ctx 32768 --prompt-tokens 512 --gen-tokens 32)
    CAP_CTX=${CTX_CAP:-240}
    IDS_ARGS=(--prompt-tokens 512 --gen-tokens 32)
    DEPTH_ARGS=(--prompt-tokens 16384 --gen-tokens 32)
    CAP_BUILD=285 CAP_SYNTH=15 CAP_CHECKS=75 CAP_BENCH=${BENCH_CAP:-110} CAP_PROFILE=30 CAP_PREFILL=${PREFILL_CAP:-240}
    CAP_OPS=30 CAP_IDS=${IDS_CAP:-240} CAP_DEPTH=${DEPTH_CAP:-240}
    SANITIZER=(compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20)
    OPS_BACKEND=CUDA0
fi
SERIES_OPS=MUL_MAT_ID_SKIP,ADD_ID_SKIP,MOE_GATE
# the cache test compute-sanitizer runs: slots, a multi-token ubatch (the MMQ path that read out of bounds)
SANITIZED_TEST="tests/test_gpu.py::test_cache_on_gpu_close_to_experts_on_cpu[edgemoe-tiny-mixtral-2-lru]"
FAILED=0

record() {  # record NAME STATUS SECONDS CAP: one line of summary.txt
    printf '%-8s %-10s %4d s  (cap %d s)\n' "$2" "$1" "$3" "$4" | tee -a "$WORK/summary.txt"
    # only the profile may be cut at its cap: a capped build, check or bench left something unchecked
    [ "$2" = ok ] || { [ "$2" = capped ] && [ "$1" = profile ]; } || FAILED=$((FAILED + 1))
}

status_of() {  # status_of RC: ok, capped (timeout's 124) or fail
    case $1 in 0) echo ok ;; 124) echo capped ;; *) echo "fail($1)" ;; esac
}

runtime_env() {  # after the build: the workaround for the CUDA library's static C++ runtime (docs/build.md)
    local lib=/lib/x86_64-linux-gnu/libstdc++.so.6
    if [ "$DRY" != 1 ] && [ "${GPU_CHECK_PRELOAD_LIBSTDCXX:-1}" = 1 ] && [ -f "$lib" ]; then
        export LD_PRELOAD=$lib
    fi
}

start_synth() {  # the bench's model, written in the background while the build compiles
    if [ -f "$SYNTH_OUT" ]; then SYNTH_PID=""; return; fi
    "$PY" tools/synth_gguf.py "$SYNTH_PRESET" --out "$SYNTH_OUT.tmp" --quiet > "$LOGS/synth.log" 2>&1 \
        && mv "$SYNTH_OUT.tmp" "$SYNTH_OUT" &
    SYNTH_PID=$!
}

wait_synth() {
    local t0=$SECONDS rc=0
    if [ -n "${SYNTH_PID:-}" ]; then
        # the cap counts from now: the writer has run beside the build (a polled cap: a sleeping guard
        # process would hold the caller's pipe open for the whole cap)
        while kill -0 "$SYNTH_PID" 2>/dev/null && [ $((SECONDS - t0)) -lt "$CAP_SYNTH" ]; do sleep 1; done
        kill "$SYNTH_PID" 2>/dev/null
        wait "$SYNTH_PID"; rc=$?
        [ -f "$SYNTH_OUT" ] || [ "$rc" != 0 ] || rc=1
    fi
    record synth "$(status_of "$rc")" $((SECONDS - t0)) "$CAP_SYNTH"
}

build_cmds() {  # the build; in a dry run only what needs no CUDA: the venv's llama_cpp and test-backend-ops
    if [ "$DRY" = 1 ]; then
        "$PY" -c 'import llama_cpp, edgemoe.runtime.op_tests as o; print("stub build: llama_cpp", llama_cpp.__version__, "test-backend-ops", o.backend_ops_binary())'
        return
    fi
    "$PY" -m pip install -q --no-deps .devcarry/wheels/*.whl || return 1
    # the C++ runtime check (docs/build.md) only warns here: one lent call must not end at the build if the
    # link fix did not hold on that machine; the warning is in build.log and the loader's guard covers the run
    EDGEMOE_CXX_RUNTIME_CHECK=${EDGEMOE_CXX_RUNTIME_CHECK:-warn} \
    EDGEMOE_SDIST="$ROOT/.devcarry/llama_cpp_python-0.3.36-trimmed.tar.gz" \
        "$PY" tools/build_llama.py --venv "$PREFIX" --cuda --cuda-arch "${CUDA_ARCH:-90}" \
        --cmake-args "-DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF" || return 1
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
}

step_build() {
    local t0=$SECONDS
    start_synth
    export -f build_cmds; export PY PREFIX ROOT DRY
    timeout "$CAP_BUILD" bash -c build_cmds > "$LOGS/build.log" 2>&1
    local rc=$?
    cp .build/build-cuda.log "$LOGS/build-cuda.log" 2>/dev/null
    record build "$(status_of $rc)" $((SECONDS - t0)) "$CAP_BUILD"
    return $rc
}

built() {  # a warm machine's build: the CUDA build directory and the installed stamp
    [ -d .build/cmake-cuda ] && [ -f "$PREFIX/.edgemoe-llama-stamp.json" ]
}

check_doctor() {
    timeout "$CAP_CHECKS" "$PY" -m edgemoe.cli doctor --json --timeout 60 > "$WORK/doctor.json" 2> "$LOGS/doctor.err"
}

check_tests() {  # pytest -m gpu, one process per test: a crash ends its own test only
    local ids=$WORK/gpu-tests.ids
    "$PY" -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/test_gpu.py 2> "$LOGS/collect.err" \
        | grep '::' > "$ids"
    mkdir -p "$LOGS/tests"
    if [ "$DRY" = 1 ]; then sed -i 2q "$ids"; fi  # the plumbing: two tests (skipped without a GPU)
    # shellcheck disable=SC2016
    timeout "$CAP_CHECKS" xargs -a "$ids" -d '\n' -P "${TEST_JOBS:-8}" -I{} bash -c '
        log="$0/tests/$(echo "$1" | tr -c "A-Za-z0-9_.-" _).log"
        "$2" -m pytest -q -m gpu -p no:cacheprovider "$1" > "$log" 2>&1
        rc=$?
        case $rc in 0) s=pass ;; 5) s=none ;; 1) s=FAIL ;; *) s="CRASH($rc)" ;; esac
        grep -q "skipped" "$log" && [ $rc = 0 ] && s=skip
        echo "$s $1"' "$LOGS" {} "$PY" > "$WORK/gpu-tests.txt"
    local rc=$?
    [ -s "$ids" ] || rc=1
    grep -vq '^\(pass\|skip\) ' "$WORK/gpu-tests.txt" && rc=1
    [ "$(wc -l < "$WORK/gpu-tests.txt")" = "$(wc -l < "$ids")" ] || [ "$rc" != 0 ] || rc=1  # some never ran
    return "$rc"
}

step_ops() {  # the series' op cases on the GPU first: a kernel that misreads a skipped id crashes here, not in a test
    local t0=$SECONDS exe rc
    exe=$("$PY" -c 'from edgemoe.runtime.op_tests import backend_ops_binary; print(backend_ops_binary())')
    rc=$?
    if [ $rc = 0 ]; then
        timeout "$CAP_OPS" "$exe" test -b "$OPS_BACKEND" -o "$SERIES_OPS" > "$LOGS/backend-ops.log" 2>&1
        rc=$?
    fi
    record ops "$(status_of $rc)" $((SECONDS - t0)) "$CAP_OPS"
    grep -E "tests passed|FAIL|crash|error" "$LOGS/backend-ops.log" | head -n 5
}

check_sanitizer() {
    timeout "$CAP_CHECKS" "${SANITIZER[@]}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "$SANITIZED_TEST" \
        > "$LOGS/sanitizer.log" 2>&1
}

check_calibration() {  # what the bench's static and daop rows need, made beside the tests instead of in its time
    timeout "$CAP_CHECKS" "$PY" -m edgemoe.cli generate "$BENCH_MODEL" -p "The" -n 1 --temp 0 --ctx 256 \
        --expert-slots 8 --policy static > "$LOGS/calibration.log" 2>&1
}

step_checks() {  # the four checks at once: the GPU and 16 cores hold them
    local t0=$SECONDS names=(doctor tests sanitizer calibration) pids=() i
    for i in "${names[@]}"; do
        if [ "$i" = calibration ] && [ ! -f "$BENCH_MODEL" ]; then pids+=(""); continue; fi
        ( t=$SECONDS; "check_$i"; rc=$?; echo "$rc $((SECONDS - t))" > "$WORK/$i.rc" ) &
        pids+=($!)
    done
    for i in "${!names[@]}"; do
        [ -n "${pids[$i]}" ] || { record "${names[$i]}" "fail(no model)" 0 "$CAP_CHECKS"; continue; }
        wait "${pids[$i]}"
        read -r rc secs < "$WORK/${names[$i]}.rc"
        record "${names[$i]}" "$(status_of "$rc")" "$secs" "$CAP_CHECKS"
    done
    echo "checks: $((SECONDS - t0)) s"
    summarize_doctor
    grep -v '^\(pass\|skip\) ' "$WORK/gpu-tests.txt" 2>/dev/null
    grep -E "ERROR SUMMARY|passed|failed" "$LOGS/sanitizer.log" | tail -n 2
}

summarize_doctor() {
    "$PY" - "$WORK/doctor.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"doctor: no report ({err})")
for s in r["steps"]:
    print("  doctor", "ok  " if s["ok"] else "FAIL", s["name"], s["error"] or "")
EOF
}

step_bench() {
    local t0=$SECONDS
    timeout "$CAP_BENCH" "$PY" -m edgemoe.cli bench "$BENCH_MODEL" --vram "${BENCH_VRAM:-8GiB}" "${BENCH_ARGS[@]}" \
        --policy lru --policy static --policy daop --profile none --speculate lookup --draft-max 4 ${BENCH_EXTRA:-} --json \
        > "$WORK/bench.json" 2> "$LOGS/bench.err"
    local rc=$?
    record bench "$(status_of $rc)" $((SECONDS - t0)) "$CAP_BENCH"
    "$PY" - "$WORK/bench.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"bench: no report ({err})")
print(" ", r["device"], "vram", r["vram"], "prompt", r["prompt_tokens"], "slots/layer", r["slots_per_layer"])
for row in r["rows"]:
    sp = row.get("speculation") or {}
    extra = f'  accepted {sp["acceptance"]:.2f}, {sp["tokens_per_step"]:.2f} tok/step' if sp else ""
    print(f'  {row["name"]:28} prefill {row["prefill_tps"]:8.1f}  decode {row["decode_tps"]:7.2f}{extra}')
EOF
}

step_prefill() {  # a long prompt: an 8K-token prompt's prefill, each side at the -ub the plan picks on PREFILL_PROFILE
    local t0=$SECONDS
    timeout "$CAP_PREFILL" "$PY" -m edgemoe.cli bench "$BENCH_MODEL" --vram "${BENCH_VRAM:-8GiB}" "${PREFILL_ARGS[@]}" \
        --policy static --profile "${PREFILL_PROFILE:-h100-server}" --json \
        > "$WORK/prefill.json" 2> "$LOGS/prefill.err"
    local rc=$?
    record prefill "$(status_of $rc)" $((SECONDS - t0)) "$CAP_PREFILL"
    "$PY" - "$WORK/prefill.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"prefill: no report ({err})")
print(" ", r["device"], "vram", r["vram"], "prompt", r["prompt_tokens"], r["ubatch_note"] or "-ub 512")
for row in r["rows"]:  # (the bench's projections beside them are at -ub 512: not printed)
    print(f'  {row["name"]:32} -ub {row["n_ubatch"]:5}  prefill {row["prefill_tps"]:8.1f}  TTFT {row["ttft_s"]:6.2f} s')
EOF
}

step_ctx() {  # a long context: a 32K context at the budget, f16 and q8_0 KV, static with and without context tiers
    local t0=$SECONDS kv rc=0
    for kv in f16 q8_0; do
        timeout "$CAP_CTX" "$PY" -m edgemoe.cli bench "$BENCH_MODEL" --vram "${CTX_VRAM:-${BENCH_VRAM:-8GiB}}" "${CTX_ARGS[@]}" \
            --policy static --context-tiers -ctk "$kv" -ctv "$kv" --json \
            > "$WORK/ctx-$kv.json" 2> "$LOGS/ctx-$kv.err" || rc=$?
    done
    record ctx "$(status_of $rc)" $((SECONDS - t0)) "$CAP_CTX"
    "$PY" - "$WORK" <<'PYEOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
runs = {}
for kv in ("f16", "q8_0"):
    try:
        runs[kv] = json.loads((work / f"ctx-{kv}.json").read_text())
    except (OSError, ValueError) as err:
        print(f"  ctx {kv}: no report ({err})")
(work / "ctx.json").write_text(json.dumps(runs, indent=1))
for kv, r in runs.items():
    print(" ", kv, r["device"], "vram", r["vram"], "slots", r["slots_per_layer"])
    for row in r["rows"]:
        ratio = f'  x{row["ratio_decode"]:.2f}' if row.get("ratio_decode") else ""
        print(f'  {row["name"]:32} prefill {row["prefill_tps"]:8.1f}  decode {row["decode_tps"]:7.2f}{ratio}  {row["note"]}')
PYEOF
}

print_rows() {  # print_rows FILE...: each bench report's rows, decode ratios against the best stock row of its run
    "$PY" - "$@" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except (OSError, ValueError) as err:
        print(f"  {path}: no report ({err})")
        continue
    rows = r["rows"]
    stock = max((x["decode_tps"] for x in rows if x["name"].startswith("stock")), default=0.0)
    print(" ", path.rsplit("/", 1)[-1], r["device"], "vram", r["vram"], "prompt", r["prompt_tokens"])
    for row in rows:
        ratio = f"x{row['decode_tps'] / stock:.2f}" if stock else "-"
        print(f'  {row["name"]:28} prefill {row["prefill_tps"]:8.1f}  decode {row["decode_tps"]:7.2f}  {ratio}')
EOF
}

step_ids() {  # lru in both id-row modes, CUDA graphs on and off, stock's rows beside each in the same run
    local t0=$SECONDS rc=0 mode graphs files=() f
    for graphs in on off; do
        for mode in raw fill; do
            f="$WORK/ids-$mode-graphs-$graphs.json"
            files+=("$f")
            local graph_env=()
            [ "$graphs" = off ] && graph_env=(GGML_CUDA_DISABLE_GRAPHS=1)
            env EDGEMOE_DEVICE_IDS="$mode" "${graph_env[@]}" \
                timeout "$CAP_IDS" "$PY" -m edgemoe.cli bench "$BENCH_MODEL" --vram "${BENCH_VRAM:-8GiB}" \
                "${IDS_ARGS[@]}" --policy lru --profile none --json > "$f" 2> "$LOGS/ids-$mode-$graphs.err" || rc=$?
        done
    done
    "$PY" - "$WORK/ids.json" "${files[@]}" <<'EOF' || rc=1
import json, pathlib, sys
runs = {}
for p in map(pathlib.Path, sys.argv[2:]):
    try:
        runs[p.stem] = json.loads(p.read_text())
    except (OSError, ValueError) as err:
        runs[p.stem] = {"error": str(err)}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
EOF
    record ids "$(status_of $rc)" $((SECONDS - t0)) "$CAP_IDS"
    print_rows "${files[@]}"
}

step_depth() {  # decode after a 16K-token prompt: stock's rows and lru (mainline halves from 16K to 160K)
    local t0=$SECONDS rc
    timeout "$CAP_DEPTH" "$PY" -m edgemoe.cli bench "$BENCH_MODEL" --vram "${BENCH_VRAM:-8GiB}" "${DEPTH_ARGS[@]}" \
        --policy lru --profile none --json > "$WORK/depth.json" 2> "$LOGS/depth.err"
    rc=$?
    record depth "$(status_of $rc)" $((SECONDS - t0)) "$CAP_DEPTH"
    print_rows "$WORK/depth.json"
}

step_profile() {
    local t0=$SECONDS
    timeout "$CAP_PROFILE" "$PY" -m edgemoe.cli profile --out "$WORK/profile.json" > "$LOGS/profile.log" 2>&1
    record profile "$(status_of $?)" $((SECONDS - t0)) "$CAP_PROFILE"
}

finish() {  # logs.tar.gz and the few files that come back; at most MAX_OUT_FILES in $OUT
    local f n
    tar -czf "$OUTDIR/logs.tar.gz" -C "$WORK" logs
    for f in summary.txt gpu-tests.txt doctor.json bench.json prefill.json ctx.json ids.json depth.json profile.json; do
        [ -s "$WORK/$f" ] && cp "$WORK/$f" "$OUTDIR/$f"
    done
    n=$(find "$OUTDIR" -type f | wc -l)
    echo "total: $((SECONDS - T0)) s, $FAILED failed steps, $n files in $OUTDIR" | tee -a "$OUTDIR/summary.txt"
    if [ "$n" -gt "$MAX_OUT_FILES" ]; then
        echo "error: $n files in $OUTDIR, the device returns $MAX_OUT_FILES" >&2
        return 1
    fi
    [ "$FAILED" = 0 ]
}

check_all() {  # everything after the build (the prefill rows where the call has the time: warm, dry-run)
    runtime_env
    wait_synth
    step_ops
    step_checks
    step_bench
    [ "$MODE" = all ] || step_prefill
    [ "$MODE" = all ] || step_ctx
    step_profile
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

T0=$SECONDS
[ "$MODE" = pack ] || : > "$WORK/summary.txt"
case "$MODE" in
    all | dry-run) step_build && check_all; finish ;;
    warm)
        if built; then echo "warm: the build of the last call is there, not rebuilding"; start_synth
        else step_build; fi && check_all
        finish ;;
    build) step_build; finish ;;
    ops) runtime_env; step_ops; finish ;;
    ids)
        runtime_env; CAP_SYNTH=${SYNTH_CAP:-240}; start_synth; wait_synth
        step_ops; step_ids; step_depth; finish ;;
    depth) runtime_env; CAP_SYNTH=${SYNTH_CAP:-240}; start_synth; wait_synth; step_depth; finish ;;
    doctor) runtime_env; check_doctor; summarize_doctor ;;
    tests) runtime_env; check_tests; cat "$WORK/gpu-tests.txt" ;;
    bench) runtime_env; CAP_SYNTH=${SYNTH_CAP:-240}; start_synth; wait_synth; step_bench; finish ;;
    prefill) runtime_env; CAP_SYNTH=${SYNTH_CAP:-240}; start_synth; wait_synth; step_prefill; finish ;;
    ctx) runtime_env; CAP_SYNTH=${SYNTH_CAP:-240}; start_synth; wait_synth; step_ctx; finish ;;
    profile) runtime_env; step_profile; finish ;;
    diag) runtime_env; step_diag ;;
    pack) finish ;;  # GPU_CHECK_WORK=<a run's work folder>: its logs into $OUT again
    *) echo "usage: $0 all|warm|ids|dry-run|build|ops|doctor|tests|bench|prefill|ctx|depth|profile|diag|pack" >&2; exit 2 ;;
esac
