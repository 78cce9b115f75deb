"""The server's bounds as pure parts, without a server or llama.cpp: JSON depth and strict JSON, the tool-call
parser on hostile text, the stop-string automaton against a plain reference, Host values, echoed values, the
control-token guard's placeholders, OpenAI's rule for tool messages, and the connection layer (idle connections
closed oldest first, the header timeout, a client that reads nothing) on a stand-in transport."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from edgemoe.serve.checks import check_tool_answers
from edgemoe.serve.errors import MAX_MESSAGE_CHARS, APIError, echo
from edgemoe.serve.front import HostPolicy, parse_host
from edgemoe.serve.limits import MAX_CALL_DEPTH, BodyBudget, JSONRefused, json_depth, loads_strict
from edgemoe.serve.specials import SpecialGuard
from edgemoe.serve.stops import StopScanner
from edgemoe.serve.tools import parse_call, split_calls
from edgemoe.serve.transport import TransportLimits, protocol_class


# -- JSON ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('"[[[["', 0), ('["]]]\\"[[", [1]]', 2),
    ("[" * 100_000 + "]" * 100_000, 100_000), ('{"a": "\\\\"}', 1),
])
def test_json_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth == json_depth(text.encode())


@pytest.mark.parametrize("text", ['{"x": NaN}', "[Infinity]", "[-Infinity]", "[1e400]", "9" * 4400,
                                  '["\\ud800"]', '{"\\udc00": 1}', "[" * 65 + "]" * 65, "[1,", ""])
def test_loads_strict_refuses_what_clients_cannot_read_back(text: str) -> None:
    with pytest.raises(JSONRefused):
        loads_strict(text, MAX_CALL_DEPTH)


def test_loads_strict_reads_json() -> None:
    text = '{"a": [1, 2.5, -0.0, 1e308, "\\ud83d\\ude00", null, true], "b": "' + "9" * 4300 + '"}'
    assert loads_strict(text, MAX_CALL_DEPTH) == json.loads(text)


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": NaN}}', '{"name": "f", "arguments": {"x": 1e999}}',
    '{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}", '{"name": "f", "arguments": {"x": "\\ud800"}}',
    '{"name": "f", "arguments": ' + "[" * 3000 + "]" * 3000 + "}", '{"name": "f", "arguments": "{\\"x\\": NaN}"}',
    '{"name": "a b", "arguments": {}}', '{"name": "\\ud800", "arguments": {}}', '{"name": 1, "arguments": {}}',
])
def test_calls_no_client_can_read_back_are_text(body: str) -> None:
    assert parse_call(body) is None
    text = f"hi <tool_call>{body}</tool_call> there"
    assert split_calls(text) == (text, [])


def test_a_valid_call_still_parses() -> None:
    call = parse_call('{"name": "read_file", "arguments": {"path": "\\ud83d\\ude00", "n": 1e308}}')
    assert call is not None and call.arguments == {"path": "\U0001f600", "n": 1e308}
    assert json.loads(call.arguments_json, parse_constant=lambda c: pytest.fail(c)) == call.arguments


# -- stop strings ------------------------------------------------------------------------------------------
def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The text before the first place where a stop string is complete (the longest of those ending there)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            hit = max(done, key=len)
            return text[: end - len(hit)], hit
    return text, None


def test_stop_scanner_matches_the_reference_however_the_text_is_split() -> None:
    rnd = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rnd.choice("ab") for _ in range(rnd.randint(0, 4))) for _ in range(rnd.randint(0, 4))]
        text = "".join(rnd.choice("abc") for _ in range(rnd.randint(0, 14)))
        scanner, out, i = StopScanner(stops), "", 0
        hit = False
        while i < len(text) and not hit:
            k = rnd.randint(1, 4)
            piece, i = text[i:i + k], i + k
            emitted, hit = scanner.push(piece)
            out += emitted
            assert not scanner.buf or any(s.startswith(scanner.buf) for s in scanner.stops)  # only a stop's start
        out += "" if hit else scanner.flush()
        assert (out, scanner.hit) == reference(stops, text), (stops, text)


# -- Host -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, host", [
    ("localhost", "localhost"), ("LocalHost.:8080", "localhost"), ("[::1]:80", "::1"), ("127.0.0.1:", "127.0.0.1"),
    ("a b", None), ("x:99999", None), ("[::1", None), ("[::g]", None), ("a/b", None), ("u@h", None), ("h:p", None),
])
def test_parse_host(value: str, host: str | None) -> None:
    assert parse_host(value) == host


def test_host_policy() -> None:
    local = HostPolicy(bound="127.0.0.1", names=("box.lan",))
    for host in ("localhost", "a.localhost", "127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "box.lan"):
        assert local.allows(host), host
    for host in ("attacker.example", "localhost.attacker.example", "10.0.0.1", "", "0.0.0.0"):
        assert not local.allows(host), host
    wildcard = HostPolicy(bound="0.0.0.0")
    assert wildcard.allows("10.0.0.1") and wildcard.allows("::1") and not wildcard.allows("evil.example")
    assert HostPolicy(any_host=True).allows("evil.example")


# -- errors echo little -------------------------------------------------------------------------------
def test_echo_and_message_caps() -> None:
    assert echo("abc") == "'abc'"
    long = echo("x" * 10_000)
    assert len(long) < 120 and "10000 characters" in long
    err = APIError(400, "m" * 100_000, param="p" * 100_000)
    assert len(err.message) <= MAX_MESSAGE_CHARS + 10 and err.param is not None and len(err.param) < 1100


def test_body_budget() -> None:
    budget = BodyBudget(10)
    assert budget.take(6) and not budget.take(5) and budget.take(4)
    budget.give(10)
    assert budget.held == 0 and budget.take(10)


# -- placeholders never rewrite client text ------------------------------------------------------------
def test_placeholders_are_not_client_text() -> None:
    guard = SpecialGuard([f"<|t{i}|>" for i in range(1500)])  # more control tokens than one plane of pairs
    text = "\U00100000\U00100001 \U0010fffd <|t0|> <|t1499|> \uffff"
    swapped, changed = guard.neutralize(text)
    assert changed and "<|" not in swapped
    assert guard.restore(swapped) == text


# -- OpenAI tool messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("messages, param", [
    ([("user", [], None), ("assistant", ["a"], None), ("tool", [], "b")], "messages.2.tool_call_id"),
    ([("user", [], None), ("tool", [], "a")], "messages.1.tool_call_id"),
    ([("assistant", ["a", "b"], None), ("tool", [], "a"), ("user", [], None)], "messages.0.tool_calls"),
    ([("assistant", ["a"], None), ("tool", [], "a"), ("user", [], None), ("tool", [], "a")], "messages.3.tool_call_id"),
])
def test_tool_messages_must_answer_calls(messages: list[tuple[str, list[str], str | None]], param: str) -> None:
    with pytest.raises(APIError) as err:
        check_tool_answers(messages)
    assert err.value.param == param


def test_answered_calls_and_an_open_last_call_pass() -> None:
    check_tool_answers([("user", [], None), ("assistant", ["a", "b"], None), ("tool", [], "b"), ("tool", [], "a"),
                        ("assistant", [], None), ("user", [], None), ("assistant", ["c"], None)])


# -- the connection layer, on a stand-in transport -----------------------------------------------------------
class FakeTransport:
    """What the protocol uses of an asyncio transport; records how it was ended."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.closed = self.aborted = False
        self.written = b""

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", self.port)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def can_write_eof(self) -> bool:
        return False


def connections(limits: TransportLimits, n: int) -> tuple[list[Any], list[FakeTransport]]:
    import uvicorn
    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never reached here
        raise AssertionError

    config = uvicorn.Config(app, log_level="warning")
    config.load()
    cls, state = protocol_class(limits), ServerState()
    protos, transports = [], []
    for i in range(n):
        proto, transport = cls(config=config, server_state=state, app_state={}), FakeTransport(40000 + i)
        proto.connection_made(transport)  # type: ignore[arg-type]
        protos.append(proto)
        transports.append(transport)
    return protos, transports


def test_idle_connections_make_room_oldest_first_and_time_out() -> None:
    async def run() -> list[FakeTransport]:
        limits = TransportLimits(header_timeout_s=0.2, max_connections=3)
        protos, transports = connections(limits, 3)
        protos[1].data_received(b"GET / HTTP/1.1\r\n")  # part of a head: still waiting for one
        more: list[Any] = []
        more_t: list[FakeTransport] = []
        cls = type(protos[0])
        for i in range(2):  # two more: the two oldest idle ones make room
            p = cls(config=protos[0].config, server_state=protos[0].server_state, app_state={})
            t = FakeTransport(50000 + i)
            p.connection_made(t)  # type: ignore[arg-type]
            more.append(p)
            more_t.append(t)
        assert [t.closed for t in transports] == [True, True, False] and not any(t.closed for t in more_t)
        await asyncio.sleep(0.4)
        return transports + more_t

    assert all(t.closed for t in asyncio.run(run()))  # the rest at the header timeout


def test_a_client_that_reads_nothing_is_dropped() -> None:
    async def run() -> FakeTransport:
        protos, transports = connections(TransportLimits(write_timeout_s=0.1), 1)
        protos[0].pause_writing()  # the transport's buffer is full: the client reads nothing
        await asyncio.sleep(0.3)
        return transports[0]

    assert asyncio.run(run()).aborted


def test_a_client_that_reads_again_is_kept() -> None:
    async def run() -> FakeTransport:
        protos, transports = connections(TransportLimits(write_timeout_s=0.1, header_timeout_s=5), 1)
        protos[0].pause_writing()
        protos[0].resume_writing()
        await asyncio.sleep(0.3)
        return transports[0]

    t = asyncio.run(run())
    assert not t.aborted and not t.closed


@pytest.mark.slow
def test_stop_scanner_cost_benchmark() -> None:
    """Benchmark (slow, prints, asserts no speed): the stop-string check at the bounds, 16 stop strings of 256
    characters, one of whose start the output keeps matching (255 characters held back) while the others never
    match. `pytest -m slow -s tests/test_serve_bounds.py -k cost` prints the figure."""
    import time

    from edgemoe.serve.worker import StopScanner as WorkerScanner  # what the worker runs

    stops = ["a" * 255 + "b"] + [chr(ord("c") + i) + "a" * 255 for i in range(15)]
    scanner = WorkerScanner(stops)
    t = time.perf_counter()
    for _ in range(600):
        scanner.push("aaaa")
    dt = time.perf_counter() - t
    assert scanner.hit is None and len(scanner.buf) == 255
    print(f"\nstop strings at the bounds: {dt / 600 * 1e6:.1f} us per token over 600 tokens")
