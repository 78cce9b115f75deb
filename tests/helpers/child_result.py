"""How a script that a test runs in a child process hands its result back: written to a file, then out at once.

Those children serve llama.cpp's RPC server from a daemon thread of their own process
(edgemoe.runtime.native.rpc_loopback_device). At the interpreter's exit that thread may still be inside ggml while
the C++ runtime's static destructors run; under load this once ended a finished run in std::terminate (SIGABRT
after rpc_round_trips.py had its counts). The file is the result, so the exit skips that teardown.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def write_and_exit(path: str | Path, result: Any, **dumps: Any) -> None:
    """Write `result` as JSON to `path` (json.dumps' keywords in `dumps`) and end the process with status 0."""
    Path(path).write_text(json.dumps(result, **dumps))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
