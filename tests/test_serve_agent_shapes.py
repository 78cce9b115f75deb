"""Coding agents' requests, in the shapes the real clients sent (tests/data/agents, recorded with
tools/agent_proxy.py), through serve's pure parts: no server, no model.

Claude Code 2.1.328 (a mid-conversation system turn, the per-session billing block, a deferred tool, an image in
a tool result, parallel results in completion order, thinking with display "omitted"), Codex CLI 0.169.0 (the
Responses API: two developer messages, a namespace tool, function calls and outputs), OpenCode 1.18.33 and
Qwen Code 0.24.4 (chat completions with text parts).
"""
from __future__ import annotations

import json
import lzma
import random
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from edgemoe.serve import anthropic as ant
from edgemoe.serve.conversation import (
    IMAGE_PLACEHOLDER,
    join_text,
    merge_leading_system,
    prefill_of,
    render_chat,
    reorder_tool_results,
)
from edgemoe.serve.errors import APIError, ContextOverflow
from edgemoe.serve.grammar import json_constraint, tool_constraint
from edgemoe.serve.reasoning import Reasoning, ReasoningScanner, opens_reasoning
from edgemoe.serve.responses import ResponseReply, ResponsesRequest
from edgemoe.serve.schemas import ChatCompletionRequest, Reply
from edgemoe.serve.scripted import Script
from edgemoe.serve.stream import ReplySplitter
from edgemoe.serve.template import ChatTemplate
from edgemoe.serve.tools import ToolCall
from edgemoe.serve.worker import Outcome

from helpers.serve_harness import TOOL_TEMPLATE

DATA = Path(__file__).parent / "data" / "agents"
# Claude Code's own test of an overflow answer (its cli.js): only this exact wording stops its retries
CLAUDE_OVERFLOW = re.compile(r"^prompt is too long: \d+ tokens > \d+ maximum$")
# a template that renders system turns wherever they are (as Qwen3's does)
ANY_SYSTEM = TOOL_TEMPLATE.replace("{{ raise_exception('a system message may only come first') }}",
                                   "<|im_start|>system\n{{ m.content }}<|im_end|>\n")


def shape(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def claude(name: str = "claude-code-request") -> ant.MessagesRequest:
    return ant.MessagesRequest.model_validate(shape(name)["body"])


def outcome(finish: str = "stop") -> Outcome:
    return Outcome(finish, 100, 5, {"timings": {}}, cached_tokens=90)


# -- Claude Code -------------------------------------------------------------------------------
def test_the_billing_block_is_left_out_of_the_system_prompt() -> None:
    body = shape("claude-code-request")["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")  # what the client sends
    first = ant.MessagesRequest.model_validate(body).chat_messages()
    other_session = json.loads(json.dumps(body).replace("cc_version=2.1.328.3c3", "cc_version=2.1.328.9f1"))
    second = ant.MessagesRequest.model_validate(other_session).chat_messages()
    assert first == second  # a new session's prompt is the previous one's
    assert first[0]["role"] == "system" and "billing" not in first[0]["content"]
    assert first[0]["content"].startswith("You are a Claude agent")
    as_string = ant.MessagesRequest.model_validate({**body, "system": "x-anthropic-billing-header: cc=1;\nBe terse."})
    assert as_string.chat_messages()[0] == {"role": "system", "content": "Be terse."}


def session(name: str) -> list[dict[str, Any]]:
    """A recorded session's requests, whole (tools/agent_record.py --session)."""
    return json.loads(lzma.decompress((DATA / f"{name}-session.json.xz").read_bytes()))["requests"]


def test_text_blocks_are_joined_with_a_newline() -> None:
    req = ant.MessagesRequest.model_validate(session("claude-code")[0]["body"])
    user = req.chat_messages()[1]
    assert user["role"] == "user"
    blocks = req.messages[0].content
    assert isinstance(blocks, list) and len(blocks) == 2
    assert user["content"] == "\n".join(b.text or "" for b in blocks)  # never run together
    assert join_text(["a", "", "b"]) == "a\nb"
    oc = ChatCompletionRequest.model_validate(shape("qwen-code-request")["body"])
    parts = oc.messages[1].content
    assert isinstance(parts, list) and len(parts) > 1
    assert oc.chat_messages()[1]["content"] == "\n".join(p.text or "" for p in parts)


def test_a_mid_conversation_system_turn_is_rendered_or_merged() -> None:
    req = claude()
    messages = req.chat_messages()
    assert [m["role"] for m in messages] == ["system", "user", "system"]  # as the client sent it
    refusing = ChatTemplate(TOOL_TEMPLATE)  # a system message may only come first
    prompt = render_chat(refusing, messages, req.template_tools())
    assert prompt.count("<|im_start|>system") == 1
    system = prompt.split("<|im_end|>")[0]
    assert "# Environment" in system and system.index("You are a Claude agent") < system.index("# Environment")
    allowing = ChatTemplate(ANY_SYSTEM)
    prompt = render_chat(allowing, messages, req.template_tools())
    assert prompt.count("<|im_start|>system") == 2
    assert prompt.index("What is in README.md?") < prompt.index("# Environment")  # in its place


def test_deferred_tools_stay_out_until_a_tool_reference_loads_them() -> None:
    body = shape("claude-code-request")["body"]
    deferred = [t["name"] for t in body["tools"] if t.get("defer_loading")]
    assert deferred == ["DeferredToolPlaceholder"]
    names = [t["function"]["name"] for t in claude().template_tools() or []]
    assert "DeferredToolPlaceholder" not in names and "Read" in names and len(names) == len(body["tools"]) - 1
    loaded = json.loads(json.dumps(body))
    loaded["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "select:DeferredToolPlaceholder"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "DeferredToolPlaceholder"}]}]}]
    req = ant.MessagesRequest.model_validate(loaded)
    assert "DeferredToolPlaceholder" in [t["function"]["name"] for t in req.template_tools() or []]


def test_an_image_in_a_tool_result_becomes_a_placeholder() -> None:
    req = claude("claude-code-image")
    blocks = req.messages[-1].content
    assert isinstance(blocks, list) and blocks[0].type == "tool_result"
    assert [c.type for c in blocks[0].content or []] == ["image"]  # type: ignore[union-attr]
    result = [m for m in req.chat_messages() if m["role"] == "tool"]
    assert result == [{"role": "tool", "tool_call_id": blocks[0].tool_use_id, "content": IMAGE_PLACEHOLDER}]
    assert req.notes() == ("1 image(s) replaced by a text placeholder: this model reads text only",)
    assert claude().notes() == ()


def test_parallel_results_follow_the_calls_order() -> None:
    req = claude("claude-code-parallel")
    messages = req.chat_messages()
    calls = [c["id"] for c in messages[-3]["tool_calls"]]
    sent = [m["tool_call_id"] for m in messages[-2:]]
    assert sent == calls[::-1]  # Claude Code sent them in completion order
    ordered = reorder_tool_results(messages)
    assert [m["tool_call_id"] for m in ordered[-2:]] == calls
    prompt = render_chat(ChatTemplate(TOOL_TEMPLATE), messages, req.template_tools())
    assert prompt.index("hello from the readme") < prompt.index("second file")  # README.md was called first
    strays = [*messages[:-2], {"role": "tool", "tool_call_id": "unknown", "content": "?"}, *messages[-2:]]
    assert [m["tool_call_id"] for m in reorder_tool_results(strays)[-3:]] == [*calls, "unknown"]


def test_the_overflow_answer_is_worded_as_claude_code_reads_it() -> None:
    err = ContextOverflow("the prompt is 23036 tokens, but the context holds 16384; shorten it",
                          prompt_tokens=23036, n_ctx=16384, param="messages")
    message = err.anthropic_body()["error"]["message"]
    assert CLAUDE_OVERFLOW.match(message) and message == "prompt is too long: 23036 tokens > 16383 maximum"
    assert err.body()["error"]["code"] == "context_length_exceeded"  # OpenAI's shape keeps the explanation
    assert "the context holds 16384" in err.body()["error"]["message"]


def test_thinking_comes_back_as_thinking_blocks() -> None:
    req = claude()
    assert req.thinking is not None and req.thinking.display == "omitted"
    parts: list[str | ToolCall | Reasoning] = [Reasoning("let me "), Reasoning("see"), "Hello."]
    shown = ant.MessageReply("m").whole(parts, outcome())
    assert [b["type"] for b in shown["content"]] == ["thinking", "text"]
    assert shown["content"][0]["thinking"] == "let me see" and shown["content"][1]["text"] == "Hello."
    omitted = ant.MessageReply("m", show_thinking=req.show_thinking).whole(parts, outcome())
    assert omitted["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    reply = ant.MessageReply("m")
    stream = reply.start(10, 0) + reply.thinking("a") + reply.thinking("b") + reply.text("c") + reply.end(outcome())
    deltas = [json.loads(line[6:])["delta"] for line in stream.splitlines()
              if line.startswith("data: ") and '"content_block_delta"' in line]
    assert deltas == [{"type": "thinking_delta", "thinking": "a"}, {"type": "thinking_delta", "thinking": "b"},
                      {"type": "text_delta", "text": "c"}]


# -- Codex: the Responses API ----------------------------------------------------------------------
def codex() -> ResponsesRequest:
    return ResponsesRequest.model_validate(shape("codex-request")["body"])


def test_codex_input_becomes_a_chat() -> None:
    req = codex()
    req.check()
    messages = req.chat_messages()
    roles = [m["role"] for m in messages]
    assert roles[:2] == ["system", "system"]  # its two developer messages ...
    merged = merge_leading_system(messages)
    assert [m["role"] for m in merged][:2] == ["system", "user"]  # ... as one
    assert merged[0]["content"] == messages[0]["content"] + "\n\n" + messages[1]["content"]
    calls = [m for m in messages if m.get("tool_calls")]
    results = [m for m in messages if m["role"] == "tool"]
    assert len(calls) == 1 and calls[0]["tool_calls"][0]["function"]["name"] == "exec_command"
    assert results[0]["tool_call_id"] == calls[0]["tool_calls"][0]["id"]
    assert "hello from the readme" in results[0]["content"]


def test_codex_namespace_tools_are_flattened_with_a_dot() -> None:
    req = codex()
    names = [t["function"]["name"] for t in req.template_tools() or []]
    assert "multi_agent_v1.spawn_agent" in names and "exec_command" in names
    assert not any(n == "web_search" for n in names)  # a hosted tool is left out
    reply = ResponseReply("m", req)
    item = reply.call_item(ToolCall("multi_agent_v1.spawn_agent", {"message": "hi"}, id="call_1"))
    assert item["name"] == "spawn_agent" and item["namespace"] == "multi_agent_v1" and item["call_id"] == "call_1"
    assert "namespace" not in reply.call_item(ToolCall("exec_command", {"cmd": "ls"}))
    bad = shape("codex-request")["body"]
    bad["tools"][0]["name"] = "exec.command"  # only a namespace may put a dot in a name
    with pytest.raises(APIError):
        ResponsesRequest.model_validate(bad).check()


def test_responses_stream_events_and_whole_reply() -> None:
    reply = ResponseReply("m", codex())
    stream = (reply.start() + reply.reasoning("hmm") + reply.text("I will ") + reply.text("look.")
              + reply.tool_call(ToolCall("exec_command", {"cmd": "ls"}, id="call_9")) + reply.end(outcome("tool_calls")))
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message", "function_call"]
    assert done[1]["content"][0]["text"] == "I will look." and done[2]["arguments"] == '{"cmd": "ls"}'
    final = events[-1]["response"]
    assert final["output"] == done and final["usage"]["input_tokens_details"]["cached_tokens"] == 90
    whole = ResponseReply("m", codex()).whole([Reasoning("hmm"), "Hi", ToolCall("exec_command", {})],
                                              outcome("length"))
    assert whole["status"] == "incomplete" and [i["type"] for i in whole["output"]] == [
        "reasoning", "message", "function_call"]


def test_responses_refuses_what_it_cannot_do_in_one_line() -> None:
    body = shape("codex-request")["body"]
    for bad, param in ((dict(body, previous_response_id="resp_1"), "previous_response_id"),
                       (dict(body, input=[{"type": "item_reference", "id": "x"}]), "input.0.type"),
                       (dict(body, tool_choice={"type": "mcp"}), "tool_choice")):
        with pytest.raises(APIError) as exc:
            req = ResponsesRequest.model_validate(bad)
            req.check()
            req.chat_messages()
        assert exc.value.status == 400 and exc.value.param == param and "\n" not in exc.value.message


# -- reasoning, tool-call gaps, forced output ------------------------------------------------------------
def split_all(text: str, scanner: ReasoningScanner) -> list[tuple[str, str]]:
    out = [p for ch in text for p in scanner.push(ch)] + scanner.flush()
    merged: list[tuple[str, str]] = []
    for kind, t in out:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + t)
        else:
            merged.append((kind, t))
    return merged


def test_reasoning_is_split_from_the_answer() -> None:
    assert split_all("<think>\nplan it\n</think>\n\nThe answer.", ReasoningScanner()) == [
        ("reasoning", "\nplan it\n"), ("text", "The answer.")]
    assert split_all("plan it</think>The answer.", ReasoningScanner(inside=True)) == [
        ("reasoning", "plan it"), ("text", "The answer.")]
    assert split_all("Use <think> tags.", ReasoningScanner()) == [("text", "Use <think> tags.")]
    assert split_all("<think>never closed", ReasoningScanner()) == [("reasoning", "never closed")]
    assert split_all("<thi", ReasoningScanner()) == [("text", "<thi")]
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("<|im_start|>assistant\n")


def events(splitter: ReplySplitter, text: str) -> list[tuple[str, Any]]:
    out = [e for ch in text for e in splitter.push(ch)] + splitter.flush()
    merged: list[tuple[str, Any]] = []
    for kind, v in out:
        if merged and kind != "tool_call" and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + v)
        else:
            merged.append((kind, v))
    return merged


CALL = '<tool_call>\n{"name": "read", "arguments": {"p": %d}}\n</tool_call>'


def test_the_newline_between_tool_calls_is_not_text() -> None:
    got = events(ReplySplitter(tools=True), "Reading.\n" + CALL % 1 + "\n" + CALL % 2 + "\n")
    assert [k for k, _ in got] == ["delta", "tool_call", "tool_call"]
    assert got[0][1] == "Reading.\n" and [c.arguments for _, c in got[1:]] == [{"p": 1}, {"p": 2}]
    after = events(ReplySplitter(tools=True), CALL % 1 + "\n\nDone.")
    assert [(k, v) for k, v in after if k == "delta"] == [("delta", "\n\nDone.")]  # real text after a call stays


def test_parallel_calls_off_ends_the_reply_after_the_first_call() -> None:
    splitter = ReplySplitter(tools=True, single_call=True)
    got = events(splitter, CALL % 1 + "\n" + CALL % 2)
    assert [k for k, _ in got] == ["tool_call"] and splitter.done and splitter.n_calls == 1


def test_reasoning_before_a_tool_call_is_not_parsed_for_calls() -> None:
    got = events(ReplySplitter(tools=True), "<think>maybe " + CALL % 0 + "</think>" + CALL % 1)
    assert [k for k, _ in got] == ["reasoning", "tool_call"] and got[1][1].arguments == {"p": 1}


def test_forced_output_grammars() -> None:
    tools = [{"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
             {"type": "function", "function": {"name": "ns.write", "parameters": {}}}]
    any_call = tool_constraint(tools, only=None, parallel=True, param="tools").grammar()
    assert any_call.startswith("root ::= body\n") and 'call ("\\n" call)*' in any_call
    assert '\\"read\\"' in any_call and '\\"ns.write\\"' in any_call
    one = tool_constraint(tools, only="read", parallel=False, param="tools").grammar(reasoning_open=True)
    assert "root ::= reasoning body" in one and "body ::= call\n" in one and "ns.write" not in one
    assert "root ::= body" in json_constraint(None, "response_format").grammar()
    with pytest.raises(APIError) as exc:  # a regex pattern the converter cannot turn into a grammar
        json_constraint({"type": "string", "pattern": "(?<=a)b"}, "response_format.json_schema.schema")
    assert exc.value.status == 400 and exc.value.code == "unsupported_schema"


def test_openai_requests_enforce_or_refuse() -> None:
    body = shape("opencode-request")["body"]
    req = ChatCompletionRequest.model_validate(body)
    assert req.constraint() is None  # tool_choice "auto"
    forced = ChatCompletionRequest.model_validate({**body, "tool_choice": {"type": "function",
                                                                           "function": {"name": "read"}}})
    c = forced.constraint()
    assert c is not None and c.what == "a call to read"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert ChatCompletionRequest.model_validate({**body, "response_format": schema}).constraint() is not None
    with pytest.raises(APIError) as exc:
        ChatCompletionRequest.model_validate({**body, "response_format": {"type": "grammar"}}).constraint()
    assert exc.value.status == 400
    image = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert image.chat_messages()[0]["content"] == f"What is this?\n{IMAGE_PLACEHOLDER}"
    assert image.notes() and "1 image" in image.notes()[0]


def test_openai_reply_carries_reasoning_content() -> None:
    reply = Reply("chat", "m")
    whole = reply.whole("Hi", outcome(), [], "thought")
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi", "reasoning_content": "thought"}
    assert reply.reasoning_chunk("t")["choices"][0]["delta"] == {"reasoning_content": "t"}


def test_an_assistant_prefill_is_continued() -> None:
    messages = [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"a":'}]
    assert prefill_of(messages) == '{"a":'
    prompt = render_chat(ChatTemplate(TOOL_TEMPLATE), messages, None)
    assert prompt.endswith('<|im_start|>assistant\n{"a":')  # the turn is open, not closed
    assert prefill_of([*messages[:1], {"role": "assistant", "content": "", "tool_calls": [{}]}]) is None


def test_scripted_replies_find_their_prompt() -> None:
    script = Script.parse([{"when": "title generator", "reply": "T"}, {"when": "tool_response", "reply": "A"},
                           "C", "D"])
    assert script.take("You are opencode ... <tool_response>") == "A"
    assert script.take("You are a title generator") == "T"
    assert script.take("anything") == "C" and script.take("x") == "D" and script.take("y") == "" and not script


# -- the real shapes, mutated: only 400s -------------------------------------------------------------------
JUNK: list[Any] = [None, True, 0, -1, 1.5, "", "x", "developer", "namespace", "function_call", "input_image",
                   "image", "tool_reference", "system", [], {}, [1], {"type": "x"}, {"type": "text", "text": 1}]


def mutated(rnd: random.Random, body: Any) -> Any:
    body = json.loads(json.dumps(body))
    for _ in range(rnd.randint(1, 3)):
        spots: list[tuple[Any, Any]] = []
        stack = [body]
        while stack:
            node = stack.pop()
            keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
            for k in keys:
                spots.append((node, k))
                stack.append(node[k])
        if not spots:
            break
        parent, key = rnd.choice(spots)
        if rnd.random() < 0.2 and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = rnd.choice(JUNK)
    return body


@pytest.mark.parametrize("name, build", [
    ("codex-request", lambda b: ResponsesRequest.model_validate(b)),
    ("claude-code-request", lambda b: ant.MessagesRequest.model_validate(b)),
    ("claude-code-image", lambda b: ant.MessagesRequest.model_validate(b)),
    ("opencode-request", lambda b: ChatCompletionRequest.model_validate(b)),
])
def test_mutated_agent_requests_are_refused_never_crash(name: str, build: Any) -> None:
    """300 mutations of each real shape through everything a route does before the engine: a body either
    converts, or is refused with a 400 (pydantic's, or ours); no other exception."""
    rnd = random.Random(52)
    template = ChatTemplate(ANY_SYSTEM)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(300):
        body = mutated(rnd, shape(name)["body"])
        try:
            req = build(body)
            req.check()
            messages, tools = req.chat_messages(), req.template_tools()
            req.constraint()
            req.notes()
            render_chat(template, messages, tools)
            outcomes["ok"] += 1
        except (ValidationError, APIError) as err:
            assert not isinstance(err, APIError) or err.status == 400, err
            outcomes["refused"] += 1
    assert outcomes["ok"] > 30 and outcomes["refused"] > 30, outcomes
