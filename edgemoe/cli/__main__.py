"""`python -m edgemoe.cli`: the edgemoe command line."""

from __future__ import annotations

from .main import main

main()
