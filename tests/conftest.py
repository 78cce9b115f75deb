"""Shared test fixtures: the bundled fixture models; the fixture modules of tests/helpers/, registered once here."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.models import FIXTURE_MODELS

# the suite's devices other than the CPU (the RPC stand-in) take skipped ids filled and masked, whatever a self-test
# or the caller's environment would pick, so that their checks of splits and id rows hold; the raw mode, the
# self-test that picks a mode and both modes on every architecture are tested explicitly (tests/test_device_ids.py,
# tests/test_ids_check.py, tests/test_cache_rpc.py), each setting EDGEMOE_DEVICE_IDS for its own processes
os.environ["EDGEMOE_DEVICE_IDS"] = "fill"

# the fixtures every test module may take by name: the synthetic models (make_tiny_gguf, tiny_gguf,
# arctic_like_gguf) and a module's `edgemoe serve` process (server)
pytest_plugins = ["helpers.synth_fixtures", "helpers.serve_harness"]


@pytest.fixture(params=FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def fixture_model(request: pytest.FixtureRequest) -> Path:
    """Each bundled fixture GGUF in models/."""
    return request.param
