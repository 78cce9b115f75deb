#!/usr/bin/env bash
# Run pytest against the AddressSanitizer + UndefinedBehaviorSanitizer build of the patched llama.cpp
# (`make asan` / `python tools/build_native_tree.py asan`), with the venv left as it is:
#
#   bash tools/asan_pytest.sh tests/test_engine.py tests/test_hooks.py ...   # or: make asan-test
#
# llama-cpp-python loads libllama from LLAMA_CPP_LIB_PATH; libasan is preloaded into Python (which is not
# instrumented); PYTHONMALLOC=malloc lets ASan see the ctypes buffers Python hands llama.cpp. Test
# subprocesses inherit all of it. Every report stops its process (UBSan's too: halt_on_error), so it fails
# the test that ran it and its text is in that test's output; ASan's reports are also written to
# $ASAN_LOGS/asan.<pid> (default .build/asan-logs, emptied first; UBSan's standalone runtime ignores
# log_path) and summed up at the end. tools/ubsan.supp lists the UBSan reports explained in docs/build.md.
# The exit status is pytest's, or 3 when pytest passed but a log holds a report.
# Environment: PYTHON (default .venv/bin/python), ASAN_LOGS.
set -uo pipefail
cd "$(dirname "$0")/.."
LIBDIR=$PWD/.build/cmake-asan/bin
PY=${PYTHON:-.venv/bin/python}
LOGS=${ASAN_LOGS:-$PWD/.build/asan-logs}
if [ ! -e "$LIBDIR/libllama.so" ]; then
    echo "no sanitizer build in $LIBDIR: run \`make asan\` first" >&2
    exit 2
fi
rm -rf "$LOGS" && mkdir -p "$LOGS"
export LLAMA_CPP_LIB_PATH=$LIBDIR
export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export PYTHONMALLOC=malloc
# leaks: CPython and ctypes keep what they allocate until exit; every other report stops the process
export ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:log_path=$LOGS/asan:print_summary=1:${ASAN_EXTRA:-}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$PWD/tools/ubsan.supp
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
n=$(cat "$LOGS"/* 2>/dev/null | grep -c "ERROR: AddressSanitizer\|runtime error:")
echo "sanitizer reports: $n (logs in $LOGS)"
cat "$LOGS"/* 2>/dev/null | grep "SUMMARY:\|runtime error:" | sort | uniq -c | sort -rn | head -n 40
[ $rc -ne 0 ] && exit $rc
[ "$n" -eq 0 ] || exit 3
