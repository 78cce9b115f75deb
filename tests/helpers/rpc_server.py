"""llama.cpp's RPC server serving this machine's CPU backend in a process of its own:
`python tests/helpers/rpc_server.py PORT` serves 127.0.0.1:PORT until killed; `rpc_server()` runs one for a block,
for tests that reach an RPC device from another process (test-backend-ops --rpc, the native tests). The server
serves one client at a time."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def rpc_server(timeout: float = 30.0) -> Iterator[str]:
    """A server on a free port for the block; yields its HOST:PORT once it accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the RPC server on port {port} did not start")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    from edgemoe.runtime import native

    native.serve_rpc(int(sys.argv[1]))
