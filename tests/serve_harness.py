"""A real `edgemoe serve` subprocess on a free port, for the server tests.

A test module imports the module-scoped `server` fixture from here; it starts one process per
test module (the bundled qwen3moe fixture, --ctx CTX, --api-key API_KEY, --max-queue 8).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
MODEL_ID = MODEL.name.removesuffix(".gguf")
API_KEY = "test-key"
CTX = 4096
MAX_QUEUE = 8
THREADS = 1  # the CPU may be shared: more threads than free cores make llama.cpp crawl


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = API_KEY, **kw: object):  # type: ignore[no-untyped-def]
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def health(self) -> dict[str, object]:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_server(log: Path, *extra: str) -> Server:
    cmd = [sys.executable, "-m", "edgemoe", "serve", str(MODEL), "--port", "0", "--ctx", str(CTX),
           "--api-key", API_KEY, "--max-queue", str(MAX_QUEUE), "-t", str(THREADS), *extra]
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 60
    port = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            port = int(m.group(1))
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
                return Server(proc, port, log)
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"edgemoe serve did not start (port {port}):\n{log.read_text(errors='replace')}")


def stop_server(server: Server) -> str:
    """SIGTERM (uvicorn's graceful shutdown); the server's log."""
    if server.alive():
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("serve") / "server.log")
    try:
        yield srv
    finally:
        log = stop_server(srv)
    assert "Traceback" not in log, log[-4000:]
    assert "graceful shutdown exceeded" not in log, log[-4000:]  # no request handler left hanging
