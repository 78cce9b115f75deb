# Two commands on a fresh machine (each installs whatever is missing into .venv):
#   make chat   - chat with the bundled fixture model
#   make test   - run the default test suite (7-9 minutes on 2 cores; `make test-long` and .ci/run: the rest)
# CUDA build: make install EDGEMOE_CUDA=1 [EDGEMOE_CUDA_ARCH=90]
# Outside the default CI (each takes long on a small machine; docs/build.md):
#   make asan        - the patched llama.cpp with ASan + UBSan (CPU + RPC) in .build/cmake-asan
#   make asan-test   - the native-path tests against it (ASAN_TESTS=... to pick others)
#   make cuda-check  - the whole patched tree compiled and linked with CUDA for sm_89 (CUDA_CHECK_ARCH)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
# the checkers, pinned as in pyproject.toml's test extra
RUFF := ruff==0.17.6
PYRIGHT := pyright==1.1.414

.PHONY: install llama chat test test-long lint typecheck clean-build asan asan-test cuda-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	touch $@

# the patched llama.cpp; the tool itself skips the build when nothing changed
llama: | $(PY)
	$(PY) tools/build_llama.py

$(VENV)/.edgemoe: pyproject.toml $(VENV)/.torch | $(PY)
	$(PY) -m pip install -q -e '.[test,serve]'
	touch $@

install: llama $(VENV)/.edgemoe

chat: install
	$(VENV)/bin/edgemoe chat

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the long checks CI runs beside the default suite (marker `long`: the architecture sweep and other multi-minute tests)
test-long: install
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

$(VENV)/bin/ruff: | $(PY)
	$(PY) -m pip install -q $(RUFF)

$(VENV)/bin/pyright: | $(PY)
	$(PY) -m pip install -q $(PYRIGHT)

# ruff's lint rules on edgemoe/, tests/ and tools/, its formatting on edgemoe/ (configured in pyproject.toml)
lint: | $(VENV)/bin/ruff
	$(VENV)/bin/ruff check edgemoe tests tools
	$(VENV)/bin/ruff format --check edgemoe

# pyright (basic) on edgemoe/, against the installed dependencies (llama-cpp-python's bindings included)
typecheck: install | $(VENV)/bin/pyright
	$(VENV)/bin/pyright --pythonpath $(abspath $(PY))

clean-build:
	rm -rf .build

# the suite's load, cache, hook, gating, predictor, prefill and RPC tests
ASAN_TESTS ?= tests/test_native.py tests/test_engine.py tests/test_load_params.py tests/test_hooks.py \
	tests/test_expert_cache.py tests/test_cache_tables.py tests/test_gating_native.py \
	tests/test_predictors_native.py tests/test_promoe_native.py tests/test_device_prefill.py \
	tests/test_cache_rpc.py tests/test_doctor.py
CUDA_CHECK_ARCH ?= 89

asan: | $(PY)
	$(PY) tools/build_native_tree.py asan

asan-test: | $(PY)
	PYTHON=$(PY) bash tools/asan_pytest.sh -m "not gpu" $(ASAN_TESTS)

cuda-check: | $(PY)
	$(PY) tools/build_native_tree.py cuda-check --cuda-arch $(CUDA_CHECK_ARCH)
