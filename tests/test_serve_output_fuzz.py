"""The tool-call parser under hostile model output, through a real server (`--scripted-replies`): NaN and
Infinity, huge integers and floats, deep nesting, lone-surrogate escapes, invalid names and arguments, broken
tags, and a seeded fuzz of such outputs. Every reply, whole or streamed, on both APIs, is a 200 whose tool calls
carry strict JSON objects as arguments; a call that does not parse is given back as text, unchanged; the log
holds no traceback.
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.serve_harness import API_KEY, MODEL_ID, Server, running, tool_model

SEED = 53
N_RANDOM = 60
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
OPENAI_TOOL = {"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "read_file", "input_schema": SCHEMA}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
KINDS = ("openai", "openai-stream", "anthropic", "anthropic-stream")


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def x(value: str) -> str:
    return '{"x": ' + value + "}"


def args(value: str, name: str = '"read_file"') -> str:
    return call(f'{{"name": {name}, "arguments": {value}}}')


# outputs whose every call must come back as text (the reply's text is the output, unchanged)
AS_TEXT = [
    args('{"x": NaN}'), args('{"x": Infinity}'), args('{"x": -Infinity}'), args('{"x": 1e400}'),
    args('{"x": -1e999}'), args(x("9" * 5000)), args(x("[" * 3000 + "]" * 3000)),
    args(x("[" * 70 + "]" * 70)), args('{"x": "\\ud800"}'), args('{"x": "a\\udc00b"}'),
    args('{"\\ud800": 1}'), args('{"x": "\\udc00\\ud800"}'), args("{}", name='"\\ud800"'),
    args('"{\\"x\\": NaN}"'), args(json.dumps("[" * 3000 + "]" * 3000)), args('"{\\"x\\": \\"\\\\ud800\\"}"'),
    args("{}", name='"read file"'), args("{}", name='""'), args("{}", name="123"), args("{}", name="null"),
    args("{}", name=json.dumps("a" * 65)), args("[1, 2]"), args('"not json"'), args("5"), args("null"),
    call('{"name": "read_file", "arguments": {}} trailing'), call(""), call("[" * 5000),
    call('{"arguments": {}}'), "<tool_call>" + '{"name"', "text <tool_call>" + "{" * 2000,
]
# outputs with valid calls (arguments as the model wrote them, re-encoded)
VALID = [
    args('{"path": "README.md"}'), args('{"x": 1e308, "y": -0.0, "z": 1.5e-400, "n": ' + "9" * 100 + "}"),
    args('{"x": "\\ud83d\\ude00 \\u0000 ok"}'), args('"{\\"path\\": \\"a\\"}"'),
    args(x("[" * 60 + "]" * 60)), "before " + args("{}") + " between " + args('{"a": [1]}') + " after",
    "<tool_call>" + '{"name": "read_file", "arguments": {"path": "x"}}',  # unclosed but whole: a call
    "".join(args(f'{{"i": {i}}}') for i in range(40)),
]
FRAGMENTS = ['"a"', "1", "-2.5", "NaN", "Infinity", "-Infinity", "1e400", "9" * 4400, "true", "null", '"\\ud800"',
             '"\\ud83d\\ude00"', '"\\u0000"', "[]", "{}", '"<tool_call>"', '"</tool_call>"', "<tool_call>", "</tool_call>"]


def random_json(rnd: random.Random, depth: int = 0) -> str:
    kind = rnd.randrange(6 if depth < 4 else 3)
    if kind < 3:
        return rnd.choice(FRAGMENTS)
    if kind == 3:
        n = rnd.choice([1, 2, 50, 65, 200])
        return "[" * n + random_json(rnd, depth + 1) + "]" * n
    if kind == 4:
        return "[" + ", ".join(random_json(rnd, depth + 1) for _ in range(rnd.randrange(3))) + "]"
    items = [f"{rnd.choice(FRAGMENTS[:1] + FRAGMENTS[10:13])}: {random_json(rnd, depth + 1)}" for _ in range(2)]
    return "{" + ", ".join(items) + "}"


def random_outputs() -> list[str]:
    rnd = random.Random(SEED)
    out = []
    for _ in range(N_RANDOM):
        name = rnd.choice(['"read_file"', '"read_file"', '"\\ud800"', '"x y"', "1", '"f"'])
        value = random_json(rnd)
        body = rnd.choice([f'{{"name": {name}, "arguments": {value}}}',
                           f'{{"name": {name}, "arguments": {json.dumps(value)}}}',
                           f'{{"name": {name}, "parameters": {value}}}'])
        if rnd.random() < 0.2:
            body = body[: rnd.randrange(len(body))]
        text = rnd.choice(["", "Let me look. ", "<tool_call>"]) + call(body) + rnd.choice(["", " done", "</tool_call>"])
        out.append(text)
    return out


OUTPUTS = AS_TEXT + VALID + random_outputs()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("output-fuzz")
    script = d / "replies.json"
    script.write_text(json.dumps([o for o in OUTPUTS for _ in KINDS]))
    with running(d / "server.log", "--scripted-replies", str(script), "--model-id", MODEL_ID,
                 model=tool_model(d)) as s:
        yield s


def strict(text: str) -> Any:
    def refuse(c: str) -> Any:
        raise ValueError(f"{c} is not JSON")

    value = json.loads(text, parse_constant=refuse)
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # no lone surrogate
    return value


def check_call(name: str, arguments: Any) -> None:
    assert TOOL_NAME.fullmatch(name), name
    value = strict(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(value, dict), arguments
    strict(json.dumps(value, allow_nan=False))


def sse(text: str) -> list[tuple[str | None, Any]]:
    """(event name, data) of a stream's events ("[DONE]" as a string)."""
    out = []
    for block in text.split("\n\n"):
        event = next((line[7:] for line in block.split("\n") if line.startswith("event: ")), None)
        data = next((line[6:] for line in block.split("\n") if line.startswith("data: ")), None)
        if data is not None:
            out.append((event, data if data == "[DONE]" else strict(data)))
    return out


def ask(srv: Server, kind: str) -> tuple[str, list[tuple[str, Any]]]:
    """One request of this kind: (the reply's text, its tool calls as (name, arguments))."""
    anthropic = kind.startswith("anthropic")
    body: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 8192, "stream": kind.endswith("stream"),
                            "messages": [{"role": "user", "content": "hi"}],
                            "tools": [ANTHROPIC_TOOL if anthropic else OPENAI_TOOL]}
    path = "/messages" if anthropic else "/chat/completions"
    r = httpx.post(f"{srv.base_url}{path}", json=body, timeout=60,
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text[:500]
    if kind == "openai":
        msg = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        return msg["content"] or "", calls
    if kind == "anthropic":
        blocks = r.json()["content"]
        return ("".join(b["text"] for b in blocks if b["type"] == "text"),
                [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])
    events = sse(r.text)
    assert all(e != "error" and not (isinstance(d, dict) and "error" in d) for e, d in events), r.text[-500:]
    if kind == "openai-stream":
        assert events[-1][1] == "[DONE]"
        deltas = [d["choices"][0]["delta"] for _, d in events[:-1] if d.get("choices")]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
        return "".join(d.get("content") or "" for d in deltas), calls
    assert events[-1][0] == "message_stop"
    text, calls, open_call = "", [], None
    for _, d in events:
        if d["type"] == "content_block_start" and d["content_block"]["type"] == "tool_use":
            open_call = [d["content_block"]["name"], ""]
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta":
            text += d["delta"]["text"]
        elif d["type"] == "content_block_delta":
            assert open_call is not None
            open_call[1] += d["delta"]["partial_json"]
        elif d["type"] == "content_block_stop" and open_call is not None:
            calls.append((open_call[0], open_call[1]))
            open_call = None
    return text, calls


def test_model_output_fuzz_gives_200s_strict_json_and_text_back(srv: Server) -> None:
    for n, output in enumerate(OUTPUTS):
        for kind in KINDS:
            text, calls = ask(srv, kind)
            for name, arguments in calls:
                check_call(name, arguments)
            if output in AS_TEXT or not calls:
                assert text == output and not calls, (n, kind, output[:200], text[:200], calls)
            if output in VALID:
                assert calls, (n, kind, output[:200], text[:200])
    assert srv.alive()
    assert "Traceback" not in srv.log.read_text(errors="replace")
