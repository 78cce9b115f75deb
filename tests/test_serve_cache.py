"""Prompt caching across requests on a real server: two conversations sharing a long system prompt,
alternated as an agent and its sub-agent do, reuse their own prefixes on their second turns; states stay
with their API key; 16 concurrent requests against --max-queue 4 get 503/529 in each API's shape.

The reuse is asserted as cached-token counts; what it saves in time is measured by `edgemoe bench`
(the second request's TTFT on the same prefix), not here.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from edgemoe import Engine, LoadConfig
from edgemoe.runtime.chat import ChatMessage

from helpers.serve_harness import (
    API_KEY,
    CTX,
    MODEL,
    MODEL_ID,
    THREADS,
    Server,
    chat_reference,
    long_stream,
    running,
)

OTHER_KEY = "second-key"
SYSTEM = " ".join(f"Rule {i}: keep the code small, typed and tested; say why in one line." for i in range(40))
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-cache") / "server.log"
    with running(log, "--api-key", OTHER_KEY, "--max-queue", "4", "--prompt-cache-mib", "256") as s:
        yield s


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(MODEL, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        yield eng


def n_tokens(engine: Engine, messages: list[dict[str, str]]) -> int:
    return len(engine.tokenize(engine.format_chat([ChatMessage(m["role"], m["content"]) for m in messages]),
                               parse_special=True))


def openai_turn(srv: Server, messages: list[dict[str, str]], key: str = API_KEY) -> tuple[str, int, int]:
    """(reply, prompt tokens, cached tokens) through the openai client."""
    r = srv.client(api_key=key).chat.completions.create(model=MODEL_ID, messages=messages,  # type: ignore
                                                         max_tokens=8, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens or 0
    return r.choices[0].message.content or "", r.usage.prompt_tokens, cached


def anthropic_turn(srv: Server, messages: list[dict[str, str]], key: str = API_KEY) -> tuple[str, int, int]:
    """(reply, prompt tokens, cached tokens) through the anthropic client (system prompt apart)."""
    r = srv.anthropic(api_key=key).messages.create(model=MODEL_ID, system=messages[0]["content"],
                                                   max_tokens=8, messages=messages[1:],  # type: ignore[arg-type]
                                                   extra_body=T0)
    cached = r.usage.cache_read_input_tokens or 0
    text = r.content[0].text if r.content else ""  # type: ignore[union-attr]
    return text, r.usage.input_tokens + cached, cached


def test_alternating_conversations_reuse_their_prefixes(srv: Server, engine: Engine) -> None:
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Refactor the parser."}]
    b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write the tests for it."}]
    n_system = n_tokens(engine, a[:1])
    reply_a, n_a1, _ = openai_turn(srv, a)  # the main thread
    reply_b, n_b1, cached_b1 = anthropic_turn(srv, b)  # a sub-agent: the live state shares the system prompt
    assert n_system - 2 <= cached_b1 < n_b1
    a += [{"role": "assistant", "content": reply_a}, {"role": "user", "content": "Now the docs."}]
    b += [{"role": "assistant", "content": reply_b}, {"role": "user", "content": "Add a slow one."}]
    got_a, n_a2, cached_a2 = openai_turn(srv, a)  # back to the main thread: its state is restored
    got_b, n_b2, cached_b2 = anthropic_turn(srv, b)
    # each first prompt was reused whole, but for its last token ("assistant\n") when the reply's first
    # characters join it in a token once the reply follows
    assert n_a1 - 1 <= cached_a2 < n_a2 and n_b1 - 1 <= cached_b2 < n_b2
    assert got_a == chat_reference(engine, a, 8)[0] and got_b == chat_reference(engine, b, 8)[0]
    stats = srv.health()["prompt_cache"]
    assert stats["hits"] >= 2 and stats["entries"] >= 1  # type: ignore[index]
    assert 0 < stats["bytes"] <= stats["capacity_bytes"]  # type: ignore[index]


def test_states_stay_with_their_key(srv: Server, engine: Engine) -> None:
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which files changed?"}]
    _, n1, _ = openai_turn(srv, conv)
    _, _, cached_other = openai_turn(srv, conv, key=OTHER_KEY)  # the same prompt from another key
    assert cached_other == 0
    _, _, cached_again = openai_turn(srv, conv)  # the first key's own state comes back from the store
    assert cached_again == n1 - 1  # all but the last token, whose logits are computed afresh
    _, _, cached_other2 = anthropic_turn(srv, conv, key=OTHER_KEY)
    assert cached_other2 == n1 - 1  # and the second key's


def test_sixteen_concurrent_requests_with_max_queue_4(srv: Server) -> None:
    started, stop = threading.Event(), threading.Event()
    long = threading.Thread(target=long_stream, args=(srv, started, stop))
    long.start()
    assert started.wait(30)
    user = [{"role": "user", "content": "Hi"}]

    def one(i: int) -> tuple[str, httpx.Response]:
        if i % 2:
            return "anthropic", httpx.post(f"{srv.base_url}/messages", timeout=60,
                                           json={"model": MODEL_ID, "max_tokens": 4, "messages": user},
                                           headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
        return "openai", httpx.post(f"{srv.base_url}/chat/completions", timeout=60,
                                    json={"model": MODEL_ID, "max_tokens": 4, "messages": user},
                                    headers={"Authorization": f"Bearer {API_KEY}"})

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        deadline = time.monotonic() + 20
        while sum(f.done() for f in futures) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.health()["busy"]  # the long stream still runs: 4 requests wait, 12 were refused at once
        stop.set()
        long.join(10)
        results = [f.result(timeout=60) for f in futures]
    ok = [(api, r) for api, r in results if r.status_code == 200]
    busy = [(api, r) for api, r in results if r.status_code != 200]
    assert len(ok) == 4 and len(busy) == 12
    for api, r in busy:
        body: dict[str, Any] = r.json()
        if api == "openai":
            assert r.status_code == 503 and body["error"]["code"] == "queue_full"
        else:
            assert r.status_code == 529 and body == {"type": "error", "error": {
                "type": "overloaded_error", "message": body["error"]["message"]}}
    assert srv.alive() and srv.health()["status"] == "ok"

