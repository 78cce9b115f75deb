"""`edgemoe serve`'s HTTP layer under hostile clients, over raw sockets: connections that must time out, request
heads held to one size however TCP splits them, both body framings on every route, 405 with `Allow` and HEAD,
Host values (syntax always; without an API key only local names, against DNS rebinding), the bytes of bodies
in flight across connections, and error messages that do not echo a client's whole string.

Two servers: one with two API keys and a 2 s read timeout, one without a key (the documented default).
"""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.serve_harness import API_KEY, MODEL_ID, Server, running

OTHER_KEY = "second-key"
HEADER_TIMEOUT_S = 10  # the server's default --header-timeout
SLACK_S = 5  # a loaded 2-core machine's delay on top of a timeout
MAX_HEAD = 32 << 10  # the request head's limit (bytes)
MAX_BODY = 8 << 20  # the default --max-body-mib
BODIES_BUDGET = 8 * MAX_BODY  # the default --max-bodies-mib: 8 bodies of the largest size


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-http") / "server.log"
    with running(log, "--api-key", OTHER_KEY, "--read-timeout", "2") as s:
        yield s


@pytest.fixture(scope="module")
def open_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("serve-open") / "server.log", api_key=False) as s:
        yield s


# -- raw HTTP -------------------------------------------------------------------------------------
def connect(srv: Server, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Reader:
    """Responses read off one connection, one at a time (Content-Length framed, or to the connection's end)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def _more(self) -> bool:
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        self.buf += data
        self.eof = not data
        return bool(data)

    def response(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            if not self._more():
                raise ConnectionError(f"the connection ended before a response: {self.buf[:200]!r}")
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        if head_only:
            return int(status_line.split()[1]), headers, b""
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n and self._more():
                pass
            body, self.buf = self.buf[:n], self.buf[n:]
        else:
            while self._more():
                pass
            body, self.buf = self.buf, b""
        return int(status_line.split()[1]), headers, body

    def closed(self, within: float) -> bool:
        """Whether the server ends the connection within `within` seconds (what it sends first is read)."""
        deadline = time.monotonic() + within
        while not self.eof:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return False
            self._more()
        return True


def request(method: str, path: str, *headers: str, host: str = "127.0.0.1", body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *headers]
    if body and not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def ask(srv: Server, data: bytes, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    with connect(srv) as sock:
        sock.sendall(data)
        return Reader(sock).response(head_only=head_only)


KEY = f"x-api-key: {API_KEY}"


# -- connections time out ----------------------------------------------------------------------------
def test_idle_and_dribbling_connections_are_closed_at_the_header_timeout(srv: Server) -> None:
    silent = connect(srv)  # sends nothing at all
    kept = connect(srv)  # one request, then a byte of the next and silence (resets uvicorn's keep-alive timer)
    kept.sendall(request("GET", "/health"))
    reader = Reader(kept)
    assert reader.response()[0] == 200
    kept.sendall(b"G")
    dribble = connect(srv)  # a head sent a byte a second, never finished
    stop = threading.Event()

    def drip() -> None:
        for b in request("GET", "/health", "X-Pad: " + "a" * 60):
            if stop.wait(1.0):
                return
            try:
                dribble.sendall(bytes([b]))
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        for sock, r in ((silent, Reader(silent)), (kept, reader), (dribble, Reader(dribble))):
            assert r.closed(HEADER_TIMEOUT_S + SLACK_S), sock
    finally:
        stop.set()
        for s in (silent, kept, dribble):
            s.close()


# -- request heads: one limit, whatever the segmentation ----------------------------------------------
def send_split(sock: socket.socket, data: bytes, size: int) -> None:
    for i in range(0, len(data), size):
        sock.sendall(data[i:i + size])
        time.sleep(0.002)  # separate segments, separate reads


@pytest.mark.parametrize("size, status", [(MAX_HEAD - 2048, 200), (MAX_HEAD + 8192, 431)])
def test_the_head_limit_does_not_depend_on_how_tcp_splits_it(srv: Server, size: int, status: int) -> None:
    head = request("GET", "/health", "X-Pad: " + "a" * (size - 60))
    for split in (len(head), 1024):
        with connect(srv) as sock:
            send_split(sock, head, split)
            got = Reader(sock).response()
        assert got[0] == status, (split, got)


# -- smuggling: both framings are refused, and the connection closed, on every route -------------------
@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/nowhere"),
                                          ("POST", "/v1/chat/completions")])
def test_content_length_with_chunked_is_400_and_close_on_every_route(srv: Server, method: str, path: str) -> None:
    smuggled = request("GET", "/health")
    chunked = b"0\r\n\r\n" + smuggled
    data = request(method, path, KEY, "Content-Length: 5", "Transfer-Encoding: chunked", body=chunked)
    with connect(srv) as sock:
        sock.sendall(data)
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 400 and headers.get("connection") == "close", (status, headers, body)
        assert reader.closed(SLACK_S) and reader.buf == b""  # no second response: the smuggled request is not read


# -- 405 names what is allowed; HEAD answers like GET -------------------------------------------------------
@pytest.mark.parametrize("method, path, allowed", [("DELETE", "/health", "GET"), ("POST", "/v1/models", "GET"),
                                                   ("GET", "/v1/chat/completions", "POST"),
                                                   ("PUT", "/v1/messages", "POST")])
def test_405_carries_allow(srv: Server, method: str, path: str, allowed: str) -> None:
    status, headers, _ = ask(srv, request(method, path, KEY, "Connection: close"))
    assert status == 405 and allowed in [m.strip() for m in headers.get("allow", "").split(",")], headers


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL_ID}"])
def test_head_answers_like_get_without_a_body(srv: Server, path: str) -> None:
    status, headers, body = ask(srv, request("GET", path, KEY, "Connection: close"))
    assert status == 200
    with connect(srv) as sock:
        sock.sendall(request("HEAD", path, KEY, "Connection: close"))
        reader = Reader(sock)
        got, got_headers, _ = reader.response(head_only=True)
        assert got == 200 and got_headers["content-length"] == str(len(body))
        assert reader.closed(SLACK_S) and reader.buf == b""  # no body


# -- Host ------------------------------------------------------------------------------------------------
BAD_HOSTS = ["a b", "example.com:99999", "[::1", "exa/mple", "host:port", "x@example.com", "a\tb"]


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_invalid_host_values_get_400(srv: Server, host: str) -> None:
    status, _, body = ask(srv, request("GET", "/v1/models", KEY, "Connection: close", host=host))
    assert status == 400, body


def test_two_host_headers_get_400(srv: Server) -> None:
    status, _, _ = ask(srv, request("GET", "/v1/models", KEY, "Host: other", "Connection: close"))
    assert status == 400


LOCAL_HOSTS = ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST.",
               "app.localhost:{port}", "127.0.0.2"]
FOREIGN_HOSTS = ["attacker.example", "attacker.example:{port}", "localhost.attacker.example", "10.1.2.3:{port}"]


def test_without_a_key_only_local_host_names_are_answered(open_srv: Server) -> None:
    body = json.dumps({"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    for host in LOCAL_HOSTS + FOREIGN_HOSTS:
        h = host.format(port=open_srv.port)
        for data in (request("GET", "/v1/models", "Connection: close", host=h),
                     request("GET", "/health", "Connection: close", host=h),
                     request("POST", "/v1/chat/completions", "Connection: close", "Content-Type: application/json",
                             host=h, body=body.encode())):
            status, _, got = ask(open_srv, data)
            assert status == (200 if host in LOCAL_HOSTS else 403), (h, data[:40], got[:300])
            if status == 403:
                assert "--api-key" in json.loads(got)["error"]["message"]


def test_with_a_key_any_valid_host_is_answered(srv: Server) -> None:
    status, _, _ = ask(srv, request("GET", "/v1/models", KEY, "Connection: close", host="attacker.example"))
    assert status == 200


# -- bodies in flight: capped across connections -----------------------------------------------------------
def test_bodies_in_flight_are_capped_across_connections(open_srv: Server) -> None:
    """Eight bodies of 7.5 MiB held unfinished fill most of the budget; a ninth gets a 503 and is closed,
    long before its read timeout; once they are gone the server takes bodies again."""
    srv = open_srv  # the default read timeout (600 s): the held bodies stay
    part = (15 << 20) // 2
    head = request("POST", "/v1/chat/completions", KEY, "Content-Type: application/json",
                   f"Content-Length: {MAX_BODY - 1}")
    held = []
    try:
        for _ in range(BODIES_BUDGET // MAX_BODY):
            sock = connect(srv)
            sock.sendall(head + b" " * part)
            held.append(sock)
        last = connect(srv)
        held.append(last)
        last.sendall(head)
        reader = Reader(last)
        for _ in range((MAX_BODY >> 20) - 1):  # a MiB at a time (never the whole body), until the server answers
            if select.select([last], [], [], 0.5)[0]:
                break
            last.sendall(b" " * (1 << 20))
        status, headers, body = reader.response()
        assert status == 503 and headers.get("retry-after") and headers.get("connection") == "close", body
        assert reader.closed(SLACK_S)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    body = json.dumps({"model": "nope", "messages": [], "pad": " " * (7 << 20)}).encode()
    status, _, _ = ask(srv, request("POST", "/v1/chat/completions", KEY, "Connection: close",
                                    "Content-Type: application/json", body=body))
    assert status == 400  # read whole (and refused for its content)


# -- echoed values are cut -----------------------------------------------------------------------------
def post_json(srv: Server, path: str, obj: Any) -> tuple[int, Any, int]:
    data = json.dumps(obj).encode()
    status, _, body = ask(srv, request("POST", path, KEY, "Connection: close", "Content-Type: application/json",
                                       "anthropic-version: 2023-06-01", body=data))
    return status, json.loads(body), len(body)


def test_error_messages_do_not_echo_whole_client_strings(srv: Server) -> None:
    huge = "m" * (1 << 20)
    user = [{"role": "user", "content": "hi"}]
    status, body, size = post_json(srv, "/v1/chat/completions", {"model": huge, "messages": user})
    assert status == 404 and size < 2048 and str(len(huge)) in body["error"]["message"], body
    status, body, size = post_json(srv, "/v1/messages", {"model": huge, "max_tokens": 1, "messages": user})
    assert status == 404 and size < 2048, body
    tool = {"type": "function", "function": {"name": huge, "parameters": {"type": "object"}}}
    status, body, size = post_json(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": user,
                                                                 "tools": [tool]})
    assert status == 400 and size < 2048, body
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" + huge}}
    status, body, size = post_json(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": [
        *user, {"role": "assistant", "content": "", "tool_calls": [call]}]})
    assert status == 400 and size < 2048, body
    assert srv.alive()
