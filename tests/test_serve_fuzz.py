"""The serve app in-process (no HTTP server): a seeded fuzz of both APIs' request schemas, count_tokens'
bound, 500s that keep internal text to the log, and client text that cannot forge control tokens.

The fuzz mutates valid requests (a node replaced by a random JSON value or by arrays and objects nested up to
100,000 levels, a key dropped or added, surrogates and control-token texts in strings, NaN) and sends them through the real app and engine, with a scripted
(empty) reply so that a valid request costs only its prompt's evaluation. No answer may be a 500, and every
4xx must have the error shape of the path's API.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.serve.app import ServerConfig, create_app
from edgemoe.serve.specials import SpecialGuard, control_texts
from edgemoe.serve.template import ChatTemplate, load_template
from edgemoe.serve.worker import EngineWorker

from helpers.serve_harness import CTX, THREADS, TOOL_TEMPLATE, tool_model

MODEL_ID = "m"
N_CASES = 300
SEED = 38
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL_ID, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "data"}],
        "tools": [{"type": "function", "function": {"name": "read", "parameters": SCHEMA}}],
        "tool_choice": "auto", "stop": ["x"], "stream": False},
    "/v1/completions": {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 4, "stream": False},
    "/v1/messages": {
        "model": MODEL_ID, "max_tokens": 4, "system": [{"type": "text", "text": "S"}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "ok"},
                         {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "R"}]}]}],
        "tools": [{"name": "read", "input_schema": SCHEMA}], "tool_choice": {"type": "auto"},
        "stop_sequences": ["x"], "stream": False},
    "/v1/messages/count_tokens": {
        "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "read", "input_schema": SCHEMA}]},
}
STRINGS = ["", "x", "a\ud800b", "\udc00", "<|im_end|>", "<|im_start|>system\n", "a</tools><|im_end|>",
           "user", "assistant", "tool", "function", "text", "tool_use", "auto", "none", "object", "\u00e9\U0001f600",
           MODEL_ID, "c1", "t1", "read", "yes", "x" * 300]


def random_value(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.choice([True, False])
    if kind == 2:
        return rnd.choice([0, 1, -1, 2, 10**30, -(10**20), 4096])
    if kind == 3:
        return rnd.choice([0.5, -1.5, 1e308, 2.5, float("nan"), float("inf")])
    if kind in (4, 5):
        return rnd.choice(STRINGS)
    if kind == 6:
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(3))]
    if kind == 7:
        return {rnd.choice(STRINGS): random_value(rnd, depth + 1) for _ in range(rnd.randrange(3))}
    return {"type": rnd.choice(STRINGS), "text": random_value(rnd, depth + 1)}


def paths(node: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every position in a JSON value (the root included)."""
    yield here
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*here, i))


DEPTHS = [3, 60, 127, 129, 500, 950, 1000, 5000, 100_000]  # around the body's limit (128) and Python's recursion's


def deep_marker(rnd: random.Random) -> str:
    """A string that cases() replaces with arrays and objects nested this deep (json.dumps would recurse)."""
    return f"__deep_{rnd.choice(DEPTHS)}_{rnd.choice('[{')}__"


def expand_deep(data: bytes) -> bytes:
    def nest(m: re.Match[bytes]) -> bytes:
        n, kind = int(m.group(1)), m.group(2)
        return (b'[' * n + b'1' + b']' * n) if kind == b"[" else (b'{"a":' * n + b'1' + b'}' * n)

    return re.sub(rb'"__deep_(\d+)_([\[{])__"', nest, data)


def mutate(rnd: random.Random, body: Any) -> Any:
    body = json.loads(json.dumps(body))
    for _ in range(rnd.randint(1, 3)):
        where = rnd.choice(list(paths(body)))
        if not where:
            body = random_value(rnd) if rnd.random() < 0.1 else body
            continue
        parent = body
        for step in where[:-1]:
            parent = parent[step]
        op = rnd.randrange(4)
        if op == 0:
            parent[where[-1]] = random_value(rnd)
        elif op == 3:
            parent[where[-1]] = deep_marker(rnd)
        elif op == 1:
            del parent[where[-1]]
        elif isinstance(parent, dict):  # a key added (nesting where nothing checks it: an ignored field)
            parent[rnd.choice(STRINGS)] = deep_marker(rnd) if rnd.random() < 0.3 else random_value(rnd)
        else:
            parent.append(random_value(rnd))
    return body


def cases() -> Iterator[tuple[str, bytes]]:
    rnd = random.Random(SEED)
    for _ in range(N_CASES):
        path = rnd.choice(list(VALID))
        body = mutate(rnd, VALID[path])
        if isinstance(body, dict) and rnd.random() < 0.1:
            body["stream"] = True
        data = expand_deep(json.dumps(body).encode())  # ensure_ascii: lone surrogates travel as \ud800 escapes
        if rnd.random() < 0.05:
            data = data[: rnd.randrange(len(data))]  # cut short: not JSON
        yield path, data


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineWorker]:
    model = tool_model(tmp_path_factory.mktemp("fuzz-model"))
    with Engine(model, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        bos, eos = eng.template_tokens()
        w = EngineWorker(eng, 4, template=load_template(eng.chat_template(), bos_token=bos, eos_token=eos),
                         scripted=[])
        w.start()
        yield w
        w.stop()


def config(**kw: Any) -> ServerConfig:
    return ServerConfig(model_id=MODEL_ID, sampling=GREEDY, max_tokens=4, **kw)


def assert_error_shape(path: str, r: httpx.Response) -> None:
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"] and body["error"]["type"], body


def test_schema_fuzz_gives_no_500_and_official_error_shapes(worker: EngineWorker,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    client = TestClient(create_app(worker, config()), base_url="http://localhost", raise_server_exceptions=False)
    statuses: dict[int, int] = {}
    for n, (path, data) in enumerate(cases()):
        r = client.post(path, content=data, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (n, path, data[:400], r.text[:400])
        if r.status_code >= 400:
            assert_error_shape(path, r)
        elif r.headers["content-type"].startswith("application/json"):
            assert ("choices" in r.json()) != path.startswith("/v1/messages"), r.text[:400]
    assert statuses.get(200, 0) >= 20 and sum(v for k, v in statuses.items() if k >= 400) >= 100, statuses
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, errors[0].getMessage()  # no traceback in the log


# -- count_tokens is bounded like generation ---------------------------------------------------
class Blocked:
    """A worker's prompt_ids that waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0

    def __call__(self, **_: Any) -> list[int]:
        self.running += 1
        self.release.wait(10)
        return [1, 2, 3]


def test_count_tokens_waits_in_a_bounded_queue() -> None:
    max_queue = 2
    worker = EngineWorker(object(), max_queue)  # never started: count_tokens only tokenizes
    blocked = Blocked()
    worker.prompt_ids = blocked  # type: ignore[method-assign]
    app = create_app(worker, config())
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            tasks = [asyncio.create_task(client.post("/v1/messages/count_tokens", json=body))
                     for _ in range(max_queue + 3)]
            while sum(t.done() for t in tasks) < 2:
                await asyncio.sleep(0.01)
            assert blocked.running == 1  # one tokenizes, max_queue wait
            blocked.release.set()
            return list(await asyncio.gather(*tasks))

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code != 200]
    assert len(refused) == 2 and blocked.running == max_queue + 1
    for r in refused:
        assert r.status_code == 529 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "overloaded_error"


def test_a_500_keeps_the_exception_text_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    worker = EngineWorker(object(), 2)

    def fails(**_: Any) -> list[int]:
        raise RuntimeError("secret: /home/alice/.cache/model")

    worker.prompt_ids = fails  # type: ignore[method-assign]
    client = TestClient(create_app(worker, config()), base_url="http://localhost", raise_server_exceptions=False)
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL_ID, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text and "incident" in r.text
    assert "secret" in caplog.text  # the traceback went to the log


# -- the specials guard, with the Qwen3/Hermes template ------------------------------------------
def test_only_the_templates_control_tokens_are_parsed(worker: EngineWorker) -> None:
    eng = worker.engine
    im_end = eng.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and "<|im_end|>" in control_texts(eng)
    messages = [{"role": "user", "content": "hi<|im_end|>"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "read", "arguments": {"path": "<|im_start|>"}}}]},
                {"role": "tool", "tool_call_id": "c", "content": "<|im_end|>"}]
    im_start = eng.tokenize("<|im_start|>", add_special=False, parse_special=True)
    ids = worker.prompt_ids(messages=messages, tools=None)
    rendered = ChatTemplate(TOOL_TEMPLATE).render(messages)
    # each turn's own: user, assistant, the tool's (a user turn) and the generation prompt
    assert rendered.count("<|im_end|>") == 3 + 2 and rendered.count("<|im_start|>") == 4 + 1
    assert ids.count(im_end[0]) == 3 and ids.count(im_start[0]) == 4
    # client text is tokenized as plain text: it appears as the plain tokens of its text
    plain = eng.tokenize("hi<|im_end|>", add_special=False, parse_special=False)
    assert any(ids[i:i + len(plain)] == plain for i in range(len(ids)))
    # a request without control-token texts is tokenized exactly as before, in one piece
    benign = [{"role": "user", "content": "hi"}]
    want = eng.tokenize(ChatTemplate(TOOL_TEMPLATE).render(benign), add_special=True, parse_special=True)
    assert worker.prompt_ids(messages=benign, tools=None) == want


def test_guard_swaps_control_texts_in_keys_and_values() -> None:
    guard = SpecialGuard(["<|a|>", "<|ab|>"])
    value, swapped = guard.neutralize({"k<|a|>": ["<|ab|>x", 3, None], "n": "plain"})
    assert swapped and "<|" not in json.dumps(value, ensure_ascii=False)
    assert guard.neutralize({"n": "plain"}) == ({"n": "plain"}, False)
    assert SpecialGuard([]).neutralize("<|a|>") == ("<|a|>", False)


def test_fuzz_cases_are_seeded() -> None:
    assert list(cases())[:20] == list(cases())[:20]
    assert len({d for _, d in cases()}) > N_CASES * 0.8  # mostly different requests
