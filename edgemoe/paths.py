"""Where edgemoe keeps what it records for a user: calibrations, profiles, hashes, device self-tests."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """EDGEMOE_CACHE_DIR, else $XDG_CACHE_HOME/edgemoe, else ~/.cache/edgemoe."""
    env = os.environ.get("EDGEMOE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "edgemoe"
