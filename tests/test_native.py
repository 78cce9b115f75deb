"""The native boundary: edgemoe runs only on the patched llama.cpp."""
from __future__ import annotations

import pytest

from edgemoe.runtime import native
from edgemoe.errors import NativeLibraryError


def test_patched_library_is_loaded() -> None:
    # fails on a stock llama-cpp-python: the symbol comes from patches/0001
    assert native.patch_level() >= native.REQUIRED_PATCH_LEVEL
    native.require_patched()


def test_stock_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_patch_level", None)  # what a stock libllama looks like
    assert native.patch_level() == 0
    with pytest.raises(NativeLibraryError, match="make install"):
        native.require_patched()


def test_system_info_reports_cpu() -> None:
    assert "CPU" in native.system_info()
