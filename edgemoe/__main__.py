"""`python -m edgemoe`: the edgemoe command line."""

from __future__ import annotations

from .cli.main import main

main()
