"""Coding agents' requests against a real `edgemoe serve` (the fixture with a tool-calling template): the shapes
the real clients sent (tests/data/agents), their tools cut to the few a test needs so that prompts stay short.

Two servers: one with scripted replies, each picked by a marker in the prompt (serve.scripted), for the replies
the tiny model cannot write (reasoning, tool calls); one that samples, for the grammars that hold the model to a
JSON schema or a tool call.
"""
from __future__ import annotations

import json
import lzma
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgemoe import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY
from edgemoe.serve.conversation import IMAGE_PLACEHOLDER
from edgemoe.serve.template import ChatTemplate

from helpers.serve_harness import API_KEY, THREADS, TOOL_TEMPLATE, Server, running, tool_model

DATA = Path(__file__).parent / "data" / "agents"
MODEL_ID = "edgemoe-tiny-qwen3moe-tools"
CTX = 8192  # the servers' context: the trimmed shapes' prompts are 5-8K tokens with all their tools
CLAUDE_OVERFLOW = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")  # Claude Code's own test
THINK = "<think>I should answer briefly.</think>\n\nThe README says hello."
CALLS = ('<tool_call>\n{"name": "read", "arguments": {"filePath": "/a"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "read", "arguments": {"filePath": "/b"}}\n</tool_call>\n')
SCRIPT = [
    {"when": "MARK-THINK", "reply": THINK},
    {"when": "MARK-THINK", "reply": THINK},
    {"when": "MARK-THINK", "reply": THINK},
    {"when": "MARK-CALLS", "reply": CALLS},
    {"when": "MARK-CALLS", "reply": CALLS},
    {"when": "MARK-EXEC", "reply": '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'},
    {"when": "MARK-SPAWN", "reply": '<tool_call>\n{"name": "multi_agent_v1.spawn_agent", "arguments": '
                                    '{"message": "go"}}\n</tool_call>'},
]


def shape(name: str, keep_tools: tuple[str, ...] = ()) -> dict[str, Any]:
    """A recorded request's body for this server: its model, and only the tools named (all of them: ())."""
    body = json.loads((DATA / f"{name}.json").read_text())["body"]
    body["model"] = MODEL_ID
    if keep_tools:
        body["tools"] = [t for t in body.get("tools", []) if _tool_name(t) in keep_tools]
    return body


def _tool_name(t: dict[str, Any]) -> str:
    return str(t.get("name") or t.get("function", {}).get("name"))


def post(srv: Server, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    headers = {"x-api-key": API_KEY, "Authorization": f"Bearer {API_KEY}", "anthropic-version": "2023-06-01"}
    return httpx.post(f"http://127.0.0.1:{srv.port}{path}", json=body, headers=headers, timeout=300, **kw)


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_model(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("agent-scripted")
    (d / "script.json").write_text(json.dumps(SCRIPT))
    with running(d / "server.log", "--scripted-replies", str(d / "script.json"), "--ctx", str(CTX),
                 model=model) as srv:
        yield srv


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("agent-sampled") / "server.log", "--ctx", str(CTX), model=model) as srv:
        yield srv


# -- Claude Code's shapes ----------------------------------------------------------------------------
def test_claude_code_mid_conversation_system_turn_is_served(scripted: Server) -> None:
    body = shape("claude-code-request", ("Read",))
    assert [m["role"] for m in body["messages"]] == ["user", "system"]  # the template refuses a later system turn
    body["messages"][0]["content"][1]["text"] += " MARK-THINK"
    r = post(scripted, "/v1/messages", body)
    assert r.status_code == 200, r.text
    events = sse(r)
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]  # reasoning apart from the answer ...
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "The README says hello."
    assert not any(d["type"] == "thinking_delta" for d in deltas)  # ... and its text omitted, as asked


def test_claude_code_image_in_a_tool_result_is_a_placeholder(scripted: Server) -> None:
    body = shape("claude-code-image", ("Read",))
    body["stream"] = False
    r = post(scripted, "/v1/messages", body)
    assert r.status_code == 200, r.text
    assert r.json()["edgemoe"]["notes"] == ["1 image(s) replaced by a text placeholder: this model reads text only"]
    plain = json.loads(json.dumps(body))
    result = plain["messages"][-1]["content"][0]
    assert [c["type"] for c in result["content"]] == ["image"]
    result["content"] = [{"type": "text", "text": IMAGE_PLACEHOLDER}]
    counts = [post(scripted, "/v1/messages/count_tokens", {k: b[k] for k in ("model", "messages", "system", "tools")})
              for b in (body, plain)]
    assert counts[0].status_code == 200 and counts[0].json() == counts[1].json()  # the same prompt


def test_claude_code_overflow_is_answered_in_anthropic_words(scripted: Server) -> None:
    """The whole recorded request (23K tokens) at an 8192-token context: Claude Code's exact wording."""
    body = json.loads(lzma.decompress((DATA / "claude-code-session.json.xz").read_bytes()))["requests"][0]["body"]
    r = post(scripted, "/v1/messages", {**body, "model": MODEL_ID})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    m = CLAUDE_OVERFLOW.match(r.json()["error"]["message"])
    assert m is not None and int(m.group(1)) > CTX and int(m.group(2)) == CTX - 1
    openai = post(scripted, "/v1/chat/completions", {"model": MODEL_ID, "messages": [
        {"role": "user", "content": "To be, or not to be. " * 3000}]})
    assert openai.json()["error"]["code"] == "context_length_exceeded"
    assert f"the context holds {CTX}" in openai.json()["error"]["message"]


# -- OpenCode / Qwen Code: chat completions -------------------------------------------------------------
def test_opencode_reasoning_streams_as_reasoning_content(scripted: Server) -> None:
    body = shape("opencode-request", ("read",))
    body["messages"][1]["content"] += " MARK-THINK"
    r = post(scripted, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in sse(r) if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I should answer briefly."
    assert "".join(d.get("content") or "" for d in deltas) == "The README says hello."


def test_the_newline_between_parallel_calls_is_not_streamed(scripted: Server) -> None:
    body = shape("qwen-code-request", ("read_file",))
    body["tools"] = shape("opencode-request", ("read",))["tools"]
    body["messages"][1]["content"][-1]["text"] += " MARK-CALLS"
    chunks = sse(post(scripted, "/v1/chat/completions", body))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert all(not d.get("content") for d in deltas)  # nothing between or after the calls is text
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"filePath": "/a"}, {"filePath": "/b"}]
    one = post(scripted, "/v1/chat/completions", {**body, "stream": False, "parallel_tool_calls": False}).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1 and one["choices"][0]["finish_reason"] == "tool_calls"


# -- Codex: /v1/responses ------------------------------------------------------------------------------
def test_codex_round_trip_through_responses(scripted: Server) -> None:
    body = shape("codex-request", ("exec_command", "multi_agent_v1"))
    body["input"] = [i for i in body["input"] if i.get("type") == "message"][:3]
    body["input"].append({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                         "text": "List files. MARK-EXEC"}]})
    r = post(scripted, "/v1/responses", body)
    assert r.status_code == 200, r.text
    events = sse(r)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    call = [e["item"] for e in events if e["type"] == "response.output_item.done"][-1]
    assert call["type"] == "function_call" and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": "ls"}
    body["input"][-1]["content"][0]["text"] = "Spawn one. MARK-SPAWN"
    whole = post(scripted, "/v1/responses", {**body, "stream": False}).json()
    spawn = whole["output"][-1]
    assert spawn["namespace"] == "multi_agent_v1" and spawn["name"] == "spawn_agent"
    assert whole["usage"]["input_tokens_details"]["cached_tokens"] > 0.9 * whole["usage"]["input_tokens"]


def test_responses_with_the_openai_client(scripted: Server) -> None:
    client = scripted.client()
    r = client.responses.create(model=MODEL_ID, input="Say it. MARK-THINK", instructions="Be terse.")
    assert r.output_text == "The README says hello." and r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message"]


# -- grammars, with real sampling --------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}


def test_response_format_json_schema_is_enforced(sampled: Server) -> None:
    r = post(sampled, "/v1/chat/completions", {
        "model": MODEL_ID, "max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": "To be, or not to be"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(out) == {"word", "n"} and isinstance(out["n"], int) and len(out["word"]) <= 12
    free = post(sampled, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 64, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "To be, or not to be"}]})
    with pytest.raises(json.JSONDecodeError):  # the fixture writes no JSON unless held to it
        json.loads(free.json()["choices"][0]["message"]["content"])


def test_a_named_tool_choice_is_enforced(sampled: Server) -> None:
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
    r = post(sampled, "/v1/chat/completions", {
        "model": MODEL_ID, "max_tokens": 96, "temperature": 0, "tools": tools, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "messages": [{"role": "user", "content": "To be, or not to be"}]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r.text
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file" and set(json.loads(call["function"]["arguments"])) == {"word", "n"}
    anthropic = post(sampled, "/v1/messages", {
        "model": MODEL_ID, "max_tokens": 96, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "write_file", "input_schema": SCHEMA},
                  {"name": "read_file", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}).json()
    assert anthropic["stop_reason"] == "tool_use" and [b["type"] for b in anthropic["content"]] == ["tool_use"]


def test_an_assistant_prefill_is_continued(sampled: Server, model: Path) -> None:
    """The reply continues the final assistant turn: greedy, it equals the engine's continuation of the prompt
    rendered with the turn left open."""
    messages = [{"role": "user", "content": "To be, or not to be"}, {"role": "assistant", "content": "That is"}]
    r = post(sampled, "/v1/messages", {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "messages": messages})
    text = ChatTemplate(TOOL_TEMPLATE).render(messages[:1]) + "That is"
    assert text.endswith("<|im_start|>assistant\nThat is")
    with Engine(model, LoadConfig(n_ctx=CTX, n_threads=THREADS)) as eng:
        ids = eng.tokenize(text, parse_special=True)
        want = eng.generate(ids, max_tokens=8, sampling=GREEDY).text
    assert r.json()["content"][0]["text"] == want and want
    assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == len(ids)


def test_a_context_below_the_agents_prompts_warns_at_start(scripted: Server) -> None:
    log = scripted.log.read_text()
    assert f"warning: the context holds {CTX} tokens" in log and "--ctx 32768" in log
