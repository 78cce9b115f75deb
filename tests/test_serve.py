"""`edgemoe serve` end to end: a real server process driven by the official openai client.

Greedy replies equal Engine.generate on the same prompt (what `edgemoe generate --temp 0` prints);
concurrency, disconnects, the bounded queue and every error status; the process survives them all.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from edgemoe import GREEDY, Engine, LoadConfig

from helpers.serve_harness import (
    API_KEY,
    CTX,
    MAX_QUEUE,
    MODEL,
    MODEL_ID,
    THREADS,
    Server,
    chat_reference,
    long_stream,
    wait_idle,
)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "To be, or not to be"}],
    [{"role": "system", "content": "You are a playwright."}, {"role": "user", "content": "def main():"}],
    [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me."},
     {"role": "user", "content": "Long live the king!"}],
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(MODEL, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        yield eng


def text_reference(engine: Engine, prompt: str, n: int) -> str:
    return engine.generate(prompt, max_tokens=n, sampling=GREEDY).text


def post(server: Server, path: str, body: Any = None, *, key: str | None = API_KEY, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, **{"timeout": 30, **kw})


def test_models_and_health(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    h = server.health()
    assert h["status"] == "ok" and h["model"] == MODEL_ID and h["max_queue"] == MAX_QUEUE


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system", "multi-turn"])
def test_chat_greedy_equals_engine(server: Server, engine: Engine, messages: list[dict[str, str]]) -> None:
    text, n_tok, finish = chat_reference(engine, messages, 48)
    r = server.client().chat.completions.create(model=MODEL_ID, messages=messages,  # type: ignore[arg-type]
                                                max_tokens=48, temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage is not None and r.usage.completion_tokens == n_tok
    ext = r.model_extra["edgemoe"]  # type: ignore[index]
    assert ext["timings"]["decode_tokens"] == n_tok and "control" in ext and "gating" in ext


def test_chat_stream_equals_engine(server: Server, engine: Engine) -> None:
    messages = CONVERSATIONS[0]
    text, n_tok, finish = chat_reference(engine, messages, 40)
    stream = server.client().chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=40, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == finish
    assert "timings" in finals[0].model_extra["edgemoe"]  # type: ignore[index]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n_tok


def test_conversation_reuses_the_prefix(server: Server, engine: Engine) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "What say you?"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,  # type: ignore
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Speak again."}]
    second = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,  # type: ignore
                                            temperature=0)
    assert second.choices[0].message.content == chat_reference(engine, messages, 12)[0]
    evaluated = second.model_extra["edgemoe"]["timings"]["prompt_tokens"]  # type: ignore[index]
    assert second.usage is not None and evaluated < second.usage.prompt_tokens  # the KV prefix was kept


def test_completions_equal_engine(server: Server, engine: Engine) -> None:
    client = server.client()
    want = text_reference(engine, "ROMEO:", 32)
    r = client.completions.create(model=MODEL_ID, prompt="ROMEO:", max_tokens=32, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 32
    streamed = client.completions.create(model=MODEL_ID, prompt="ROMEO:", max_tokens=32, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_stop_strings_cut_the_reply(server: Server, engine: Engine) -> None:
    want = text_reference(engine, "ROMEO:", 40)
    stop = want.strip()[4:9]  # a piece inside the reply, after its start
    client = server.client()
    r = client.completions.create(model=MODEL_ID, prompt="ROMEO:", max_tokens=40, temperature=0,
                                  stop=[stop, "never appears"])
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_ID, prompt="ROMEO:", max_tokens=40, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want[:want.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_is_seeded(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model=MODEL_ID, prompt="ROMEO:", max_tokens=24, temperature=1.0, top_p=0.95, seed=7,
                              extra_body={"top_k": 40, "min_p": 0.05})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_eight_concurrent_requests(server: Server, engine: Engine) -> None:
    prompts = [f"{name}:" for name in ("ROMEO", "JULIET", "HAMLET", "KING", "First Citizen", "MENENIUS",
                                       "POMPEY", "Provost")]
    want = {p: text_reference(engine, p, 24) for p in prompts}
    client = server.client()

    def one(i: int) -> str:
        p = prompts[i]
        if i % 2:
            chunks = client.completions.create(model=MODEL_ID, prompt=p, max_tokens=24, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=MODEL_ID, prompt=p, max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert got == [want[p] for p in prompts]


def test_disconnect_mid_stream_frees_the_engine(server: Server, engine: Engine) -> None:
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=long_stream, args=(server, started, stop))
    t.start()
    assert started.wait(20)
    assert server.health()["busy"]
    stop.set()
    t.join(10)
    wait_idle(server, 1.5)  # the whole generation (~4000 tokens) would take several seconds
    r = server.client().completions.create(model=MODEL_ID, prompt="JULIET:", max_tokens=16, temperature=0)
    assert r.choices[0].text == text_reference(engine, "JULIET:", 16)
    assert r.model_extra["edgemoe"]["queue_s"] < 0.5  # type: ignore[index]


def test_full_queue_answers_503(server: Server) -> None:
    started, stop = threading.Event(), threading.Event()
    long = threading.Thread(target=long_stream, args=(server, started, stop))
    long.start()
    assert started.wait(20)
    client = server.client()
    with ThreadPoolExecutor(MAX_QUEUE) as pool:
        waiting = [pool.submit(client.completions.create, model=MODEL_ID, prompt="KING:", max_tokens=4,
                               temperature=0) for _ in range(MAX_QUEUE)]
        deadline = time.monotonic() + 10
        while server.health()["queued"] < MAX_QUEUE and time.monotonic() < deadline:
            time.sleep(0.02)
        r = post(server, "/chat/completions", {"model": MODEL_ID, "messages": CONVERSATIONS[0]})
        stop.set()
        long.join(10)
        assert all(f.result(timeout=30).choices[0].text for f in waiting)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"]


BAD_REQUESTS = [  # (id, path, body or raw bytes, api key, status, param)
    ("malformed-json", "/chat/completions", b'{"model": "x", "messages": [', API_KEY, 400, None),
    ("not-an-object", "/completions", b'[1, 2]', API_KEY, 400, None),
    ("no-body", "/completions", b"", API_KEY, 400, None),
    ("missing-messages", "/chat/completions", {"model": MODEL_ID}, API_KEY, 400, "messages"),
    ("missing-model", "/chat/completions", {"messages": CONVERSATIONS[0]}, API_KEY, 400, "model"),
    ("missing-prompt", "/completions", {"model": MODEL_ID}, API_KEY, 400, "prompt"),
    ("bad-temperature", "/completions", {"model": MODEL_ID, "prompt": "a", "temperature": -1}, API_KEY, 400,
     "temperature"),
    ("n-2", "/chat/completions", {"model": MODEL_ID, "messages": CONVERSATIONS[0], "n": 2}, API_KEY, 400, "n"),
    ("too-long", "/chat/completions",
     {"model": MODEL_ID, "messages": [{"role": "user", "content": "To be, or not to be. " * 800}]},
     API_KEY, 400, "messages"),
    ("too-long-stream", "/completions", {"model": MODEL_ID, "prompt": "ROMEO: " * 5000, "stream": True},
     API_KEY, 400, "prompt"),
    ("wrong-key", "/chat/completions", {"model": MODEL_ID, "messages": CONVERSATIONS[0]}, "nope", 401, None),
    ("no-key", "/completions", {"model": MODEL_ID, "prompt": "a"}, None, 401, None),
    ("unknown-model", "/chat/completions", {"model": "gpt-4o", "messages": CONVERSATIONS[0]}, API_KEY, 404,
     "model"),
]


@pytest.mark.parametrize("path, body, key, status, param", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_errors_in_openai_shape(server: Server, path: str, body: Any, key: str | None, status: int,
                                param: str | None) -> None:
    if isinstance(body, bytes):
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        r = httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=30)
    else:
        r = post(server, path, body, key=key)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["param"] == param
    assert server.alive() and server.health()["status"] == "ok"


def test_openai_client_raises_typed_errors(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=CONVERSATIONS[0])  # type: ignore
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(model=MODEL_ID, prompt="x " * (CTX + 10))
    assert exc.value.code == "context_length_exceeded"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{server.base_url}/no/such/route", headers=headers, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert server.alive()


def test_disconnect_while_waiting_for_a_whole_reply(server: Server) -> None:
    body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": CTX - 16, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        post(server, "/completions", body, timeout=httpx.Timeout(30, read=0.3))
    wait_idle(server, 1.5)
    assert server.alive()



def test_disconnect_while_queued(server: Server) -> None:
    started, stop = threading.Event(), threading.Event()
    long = threading.Thread(target=long_stream, args=(server, started, stop))
    long.start()
    assert started.wait(20)
    body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
    for stream in (False, True):  # both wait for the engine, then their clients leave
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/completions", {**body, "stream": stream}, timeout=httpx.Timeout(30, read=0.3))
    assert server.health()["queued"] == 2
    stop.set()
    long.join(10)
    wait_idle(server, 1.5)  # both skipped; their handlers end (the module's teardown checks none hangs)
    assert server.alive()


@pytest.mark.parametrize("stops, pieces, want, hit", [
    (["END"], ["ab", "cE", "N", "Dxyz"], ["ab", "c", "", ""], True),  # a stop string across pieces
    (["END"], ["ab", "cE", "x"], ["ab", "c", "Ex"], False),  # a false start is released
    (["\n\n", "ROMEO"], ["hi\n", "\nRO"], ["hi", ""], True),
    ([], ["a", "b"], ["a", "b"], False),
])
def test_stop_scanner(stops: list[str], pieces: list[str], want: list[str], hit: bool) -> None:
    from edgemoe.serve.worker import StopScanner

    scanner = StopScanner(stops)
    got, hits = [], []
    for p in pieces:
        text, h = scanner.push(p)
        got.append(text)
        hits.append(h)
        if h:
            break
    assert got == want[:len(got)] and any(hits) == hit
    assert "".join(got) + ("" if hit else scanner.flush()) == ("".join(pieces).split(stops[0])[0] if hit
                                                               else "".join(pieces))


def test_serve_help_says_localhost() -> None:
    from click.testing import CliRunner

    from edgemoe.cli import cli

    res = CliRunner().invoke(cli, ["--help"])
    assert res.exit_code == 0 and "serve" in res.output
    res = CliRunner().invoke(cli, ["serve", "--help"])
    assert res.exit_code == 0 and "127.0.0.1" in res.output and "this machine only" in res.output
    for option in ("--api-key", "--port", "--vram", "--policy", "--gating", "--ctx", "--threads", "--temp"):
        assert option in res.output


def test_serve_without_the_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from click.testing import CliRunner

    from edgemoe.cli import cli

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    res = CliRunner().invoke(cli, ["serve", str(MODEL)])
    assert res.exit_code == 1 and "pip install 'edgemoe[serve]'" in res.output
