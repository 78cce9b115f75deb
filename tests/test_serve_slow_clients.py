"""`edgemoe serve` under 2,000 slow clients, with the usual limit of 1,024 open files: 1,000 connections that
send nothing and 1,000 that send part of a request head and fall silent. The server still answers a new
client within a second, its log stays under 1 MB, and it closes every held connection within its header
timeout (or at once, to make room).
"""
from __future__ import annotations

import resource
import socket
import time
from pathlib import Path

import httpx
import pytest

from helpers.serve_harness import running

N_SILENT = N_PARTIAL = 1000
HEADER_TIMEOUT_S = 10  # the server's default --header-timeout
SLACK_S = 10  # 2,000 sockets on a loaded 2-core machine
SERVER_FILES = 1024  # the usual RLIMIT_NOFILE


def open_many(port: int, n: int, head: bytes) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        out.append(s)
    time.sleep(0.5)
    for s in out:
        if head:
            try:
                s.send(head)
            except OSError:  # closed already (over the cap)
                pass
    return out


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_two_thousand_idle_and_silent_connections(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N_SILENT + N_PARTIAL + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this test opens {need} sockets; the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    log = tmp_path / "server.log"
    with running(log, max_files=SERVER_FILES) as srv:
        t0 = time.monotonic()
        held = open_many(srv.port, N_SILENT, b"")
        held += open_many(srv.port, N_PARTIAL, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        try:
            t = time.monotonic()
            r = httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=1.0)  # a new client, answered at once
            answered = time.monotonic() - t
            assert r.status_code == 200 and answered < 1.0
            deadline = t0 + HEADER_TIMEOUT_S + SLACK_S
            open_now = list(held)
            while open_now and time.monotonic() < deadline:
                time.sleep(0.5)
                open_now = [s for s in open_now if not closed(s)]
            assert not open_now, f"{len(open_now)} of {len(held)} connections still open after the header timeout"
            closed_after = time.monotonic() - t0
            r = httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=1.0)
            assert r.status_code == 200
        finally:
            for s in held:
                s.close()
        assert srv.alive()
    size = log.stat().st_size
    assert size < 1 << 20, f"the server's log grew to {size} bytes"
    print(f"\n{len(held)} slow connections: a new client answered in {answered * 1e3:.0f} ms, all closed "
          f"{closed_after:.1f} s after the first opened, the log {size} bytes")
