"""The `edgemoe` command line (click): one module per command group, registered in main.

- main: the root group, error handling, and the registration of every command;
- model: inspect, generate, chat;  analysis: trace, trace-stats, verify, perplexity;
- calibrate: calibrate, predict-eval;  bench: bench;  serve: serve (the HTTP server in edgemoe.serve);
- options, cache_options, types: options and parameter types shared by the groups.
"""

from __future__ import annotations

from .main import cli, main

__all__ = ["cli", "main"]
