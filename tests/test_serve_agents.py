"""`edgemoe serve` for coding agents: the official anthropic client beside openai's, tool-call round trips
through a forced (scripted) output, and bad requests answered in each API's own shape.

Two server processes: the bundled fixture (real greedy sampling, compared with the engine) and a copy of it
whose chat template renders tools (serve_harness.TOOL_TEMPLATE), started with --scripted-replies so the
model "chooses" the tool calls the tests need.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from edgemoe import Engine, LoadConfig
from edgemoe.runtime.chat import ChatMessage
from edgemoe.serve.template import ChatTemplate

from helpers.serve_harness import (
    API_KEY,
    CTX,
    MODEL,
    MODEL_ID,
    THREADS,
    Server,
    chat_reference,
    running,
    tool_model,
    wait_idle,
)

SYSTEM = "You are a terse playwright."
T0 = {"temperature": 0}  # the anthropic client has no temperature argument any more: sent as an extra field
USER = [{"role": "user", "content": "To be, or not to be"}]
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ_TOOL = {"name": "read_file", "description": "Read a file of the project", "input_schema": SCHEMA}
OPENAI_TOOL = {"type": "function",
               "function": {"name": "read_file", "description": "Read a file of the project", "parameters": SCHEMA}}
CALL_TEXT = ('I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n'
             '</tool_call>')
ANSWER = "The file says hello."
SCRIPT = [CALL_TEXT, ANSWER, CALL_TEXT, CALL_TEXT, ANSWER, CALL_TEXT]  # in the order the tool tests ask


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(MODEL, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        yield eng


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    d = tmp_path_factory.mktemp("serve-tools")
    script = d / "replies.json"
    script.write_text(json.dumps(SCRIPT))
    model = tool_model(d)
    with running(d / "server.log", "--scripted-replies", str(script), model=model) as srv:
        yield srv, model


def messages_post(server: Server, body: Any, *, headers: dict[str, str] | None = None,
                  path: str = "/messages", **kw: Any) -> httpx.Response:
    h = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "content-type": "application/json",
         **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=data, headers=h, timeout=30, **kw)


# -- the anthropic client against the fixture ----------------------------------------------------
def test_anthropic_greedy_equals_chat(server: Server, engine: Engine) -> None:
    text, n_tok, finish = chat_reference(engine, [{"role": "system", "content": SYSTEM}, *USER], 40)
    r = server.anthropic().messages.create(model=MODEL_ID, max_tokens=40, extra_body=T0, system=SYSTEM,
                                           messages=USER)  # type: ignore[arg-type]
    assert r.content[0].type == "text" and r.content[0].text == text
    assert r.stop_reason == ("end_turn" if finish == "stop" else "max_tokens")
    assert r.usage.output_tokens == n_tok
    chat = engine.format_chat([ChatMessage("system", SYSTEM), ChatMessage(**USER[0])])
    n_prompt = len(engine.tokenize(chat, parse_special=True))
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == n_prompt


def test_anthropic_stream_equals_chat(server: Server, engine: Engine) -> None:
    text, n_tok, _ = chat_reference(engine, USER, 32)
    with server.anthropic().messages.stream(model=MODEL_ID, max_tokens=32, extra_body=T0,
                                            messages=USER) as stream:  # type: ignore[arg-type]
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text and len(pieces) > 1
    assert final.content[0].text == text and final.usage.output_tokens == n_tok  # type: ignore[union-attr]


def test_stop_sequences(server: Server, engine: Engine) -> None:
    text, _, _ = chat_reference(engine, USER, 40)
    stop = text.strip()[3:7]
    r = server.anthropic().messages.create(model=MODEL_ID, max_tokens=40, extra_body=T0, messages=USER,
                                           stop_sequences=[stop])  # type: ignore[arg-type]
    assert r.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_count_tokens_and_models(server: Server, engine: Engine) -> None:
    client = server.anthropic()
    n = client.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=USER)  # type: ignore[arg-type]
    want = engine.tokenize(engine.format_chat([ChatMessage("system", SYSTEM), ChatMessage(**USER[0])]),
                           parse_special=True)
    assert n.input_tokens == len(want)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert [m.id for m in server.client().models.list().data] == [MODEL_ID]


def test_401_without_the_key(server: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as exc:
        server.anthropic(api_key="wrong").messages.create(model=MODEL_ID, max_tokens=4,
                                                          messages=USER)  # type: ignore[arg-type]
    assert exc.value.status_code == 401
    assert exc.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    r = messages_post(server, {"model": MODEL_ID, "max_tokens": 4, "messages": USER},
                      headers={"x-api-key": ""})
    assert r.status_code == 401 and r.json()["type"] == "error"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    # the Bearer form works on the Anthropic API and x-api-key on OpenAI's
    r = messages_post(server, {"model": MODEL_ID, "max_tokens": 2, "messages": USER},
                      headers={"x-api-key": "", "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    r = httpx.get(f"{server.base_url}/models", headers={"x-api-key": API_KEY}, timeout=5)
    assert r.status_code == 200


def test_tools_on_a_template_without_them_are_refused(server: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as exc:
        server.anthropic().messages.create(model=MODEL_ID, max_tokens=4, messages=USER,  # type: ignore[arg-type]
                                           tools=[READ_TOOL])  # type: ignore[list-item]
    assert "tools" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as oexc:
        server.client().chat.completions.create(model=MODEL_ID, max_tokens=4, messages=USER,  # type: ignore
                                                tools=[OPENAI_TOOL])  # type: ignore[list-item]
    assert oexc.value.code == "tools_unsupported"


BAD = [  # (id, path, body, status, Anthropic error type)
    ("malformed-json", "/messages", b'{"model": "x", "messages": [', 400, "invalid_request_error"),
    ("not-an-object", "/messages", b"[1]", 400, "invalid_request_error"),
    ("no-max-tokens", "/messages", {"model": MODEL_ID, "messages": USER}, 400, "invalid_request_error"),
    ("bad-role", "/messages", {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
     400, "invalid_request_error"),
    ("temperature-over-1", "/messages", {"model": MODEL_ID, "max_tokens": 4, "messages": USER, "temperature": 1.5},
     400, "invalid_request_error"),
    ("audio", "/messages", {"model": MODEL_ID, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "audio", "source": {"type": "base64", "data": ""}}]}]},
     400, "invalid_request_error"),
    ("wrong-model", "/messages", {"model": "nope", "max_tokens": 4, "messages": USER}, 404, "not_found_error"),
    ("too-long", "/messages", {"model": MODEL_ID, "max_tokens": 4,
                               "messages": [{"role": "user", "content": "To be, or not to be. " * 800}]},
     400, "invalid_request_error"),
    ("count-malformed", "/messages/count_tokens", b"{", 400, "invalid_request_error"),
    ("ten-megabytes", "/messages", json.dumps({"model": MODEL_ID, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x" * (10 << 20)}]}).encode(), 413, "request_too_large"),
]


@pytest.mark.parametrize("path, body, status, kind", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_anthropic_errors(server: Server, path: str, body: Any, status: int,
                                          kind: str) -> None:
    r = messages_post(server, body, path=path)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    assert server.alive()


def test_context_overflow_says_the_numbers(server: Server) -> None:
    too_long = next(b[2] for b in BAD if b[0] == "too-long")
    counted = messages_post(server, {k: v for k, v in too_long.items() if k != "max_tokens"},
                            path="/messages/count_tokens")
    assert counted.status_code == 200 and counted.json()["input_tokens"] > CTX  # counting needs no room
    r = messages_post(server, too_long)  # in Anthropic's words, which Claude Code reads (not ours)
    assert r.json()["error"]["message"] == f"prompt is too long: {counted.json()['input_tokens']} tokens > {CTX - 1} maximum"


@pytest.mark.parametrize("route", ["openai", "anthropic"])
def test_context_overflow_names_the_prompt_max_tokens_and_the_context(server: Server, route: str) -> None:
    """A prompt that fills the context: 400 naming its tokens, the max_tokens asked and the context, on both APIs."""
    messages = [{"role": "user", "content": "To be, or not to be. " * 800}]
    counted = messages_post(server, {"model": MODEL_ID, "messages": messages}, path="/messages/count_tokens")
    n = counted.json()["input_tokens"]
    body = {"model": MODEL_ID, "max_tokens": 7, "messages": messages}
    if route == "anthropic":  # Anthropic's own wording: the numbers Claude Code parses
        r = messages_post(server, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"] == f"prompt is too long: {n} tokens > {CTX - 1} maximum"
        return
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    message = r.json()["error"]["message"]
    assert f"the prompt is {n} tokens and max_tokens asks for 7 more, but the context holds {CTX}" in message
    assert server.alive()


def test_ten_megabytes_on_openai_and_unknown_fields(server: Server) -> None:
    big = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "x" * (10 << 20)}]}).encode()
    r = httpx.post(f"{server.base_url}/chat/completions", content=big, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    body = {"model": MODEL_ID, "max_tokens": 3, "messages": USER, "metadata": {"user_id": "u"}, "no_such": [1],
            "thinking": {"type": "disabled"}}
    r = messages_post(server, body)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(f"{server.base_url}/chat/completions", json={**body, "parallel_tool_calls": True},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_chunked_bodies_are_held_to_the_limit(server: Server) -> None:
    """Without Content-Length the body is counted as it comes: 413 past the limit, served below it."""
    def body(n_mib: int) -> Iterator[bytes]:
        yield b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "' % MODEL_ID.encode()
        for _ in range(n_mib):
            yield b"x" * (1 << 20)
        yield b'Hi"}]}'

    h = {"x-api-key": API_KEY, "content-type": "application/json"}
    r = httpx.post(f"{server.base_url}/messages", content=body(10), headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(f"{server.base_url}/messages", content=body(0), headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_disconnect_mid_stream_frees_the_engine(server: Server) -> None:
    body = {"model": MODEL_ID, "max_tokens": CTX - 64, "temperature": 0, "stream": True, "messages": USER}
    h = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{server.base_url}/messages", json=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas >= 3:
                break  # leaving the block closes the connection mid-stream
    wait_idle(server, 2.0)  # ~4000 tokens would take far longer
    assert server.alive()


# -- tool calls through the forced output ------------------------------------------------------
def prompt_tokens(model: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    with Engine(model, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        text = ChatTemplate(eng.chat_template() or "").render(messages, tools)
        return len(eng.tokenize(text, parse_special=True))


def test_openai_tool_round_trip(tools_server: tuple[Server, Path]) -> None:
    srv, model = tools_server
    client = srv.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "What is in the README?"}]
    r = client.chat.completions.create(model=srv_model_id(srv), messages=messages,  # type: ignore[arg-type]
                                       tools=[OPENAI_TOOL], max_tokens=64)  # type: ignore[list-item]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will read it.\n"
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "README.md"}
    assert r.usage.prompt_tokens == prompt_tokens(model, messages, [OPENAI_TOOL])  # type: ignore[union-attr]
    messages += [{"role": "assistant", "content": choice.message.content,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": "read_file", "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "hello"}]
    r2 = client.chat.completions.create(model=srv_model_id(srv), messages=messages,  # type: ignore[arg-type]
                                        tools=[OPENAI_TOOL], max_tokens=64)  # type: ignore[list-item]
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    rendered = [*messages[:2], {**messages[2], "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "read_file", "arguments": {"path": "README.md"}}}]},
        messages[3]]
    assert r2.usage.prompt_tokens == prompt_tokens(model, rendered, [OPENAI_TOOL])  # type: ignore[union-attr]
    # the first prompt is reused whole (the scripted reply itself was never evaluated)
    assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(model=srv_model_id(srv), messages=messages[:2],  # type: ignore
                                                 tools=[OPENAI_TOOL], max_tokens=64, stream=True))  # type: ignore
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "I will read it.\n"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "read_file"  # type: ignore
    assert json.loads(calls[0].function.arguments) == {"path": "README.md"}  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_anthropic_tool_round_trip(tools_server: tuple[Server, Path]) -> None:
    srv, model = tools_server
    client = srv.anthropic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in the README?"}]
    r = client.messages.create(model=srv_model_id(srv), max_tokens=64, system=SYSTEM, tools=[READ_TOOL],  # type: ignore
                               messages=messages)  # type: ignore[arg-type]
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    use = r.content[1]
    assert use.name == "read_file" and use.input == {"path": "README.md"}  # type: ignore[union-attr]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore
                                               "content": "hello"}]}]
    r2 = client.messages.create(model=srv_model_id(srv), max_tokens=64, system=SYSTEM, tools=[READ_TOOL],  # type: ignore
                                messages=messages)  # type: ignore[arg-type]
    assert r2.content[0].text == ANSWER and r2.stop_reason == "end_turn"  # type: ignore[union-attr]
    rendered = [{"role": "system", "content": SYSTEM}, messages[0],
                {"role": "assistant", "content": "I will read it.\n", "tool_calls": [
                    {"id": use.id, "type": "function",  # type: ignore[union-attr]
                     "function": {"name": "read_file", "arguments": {"path": "README.md"}}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "hello"}]  # type: ignore[union-attr]
    n = prompt_tokens(model, rendered, [OPENAI_TOOL])
    assert r2.usage.input_tokens + (r2.usage.cache_read_input_tokens or 0) == n
    assert client.messages.count_tokens(model=srv_model_id(srv), system=SYSTEM, tools=[READ_TOOL],  # type: ignore
                                        messages=messages).input_tokens == n  # type: ignore[arg-type]
    with client.messages.stream(model=srv_model_id(srv), max_tokens=64, tools=[READ_TOOL],  # type: ignore
                                messages=messages[:1]) as stream:  # type: ignore[arg-type]
        json_parts = [e.partial_json for e in stream if e.type == "input_json"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert json.loads("".join(json_parts)) == {"path": "README.md"}
    assert final.stop_reason == "tool_use" and final.content[1].input == {"path": "README.md"}  # type: ignore


def test_a_role_order_the_template_refuses(tools_server: tuple[Server, Path]) -> None:
    srv, _ = tools_server
    assistant_first = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "hi"}]
    r = messages_post(srv, {"model": srv_model_id(srv), "max_tokens": 4, "messages": assistant_first})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "must start with a user message" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client().chat.completions.create(model=srv_model_id(srv), messages=assistant_first)  # type: ignore
    assert exc.value.code == "template_refused"
    assert srv.alive()


def srv_model_id(srv: Server) -> str:
    return srv.client().models.list().data[0].id
