"""The server's pure parts, without a server or llama.cpp: the prompt-cache store and which state a request
starts from, the tool-call scanner, the Jinja chat template, Anthropic's conversions, events and errors."""
from __future__ import annotations

import json
from typing import Any

import pytest

from edgemoe.runtime.prompt_cache import KVSnapshot, PromptCache, common_prefix
from edgemoe.serve import anthropic as ant
from edgemoe.serve.conversation import IMAGE_PLACEHOLDER
from edgemoe.serve.errors import APIError
from edgemoe.serve.prefix_cache import PrefixReuse
from edgemoe.serve.template import ChatTemplate, load_template
from edgemoe.serve.tools import ToolCall, ToolCallScanner, split_calls
from edgemoe.serve.worker import Outcome

from helpers.fake_engine import FakeEngine
from helpers.serve_harness import TOOL_TEMPLATE


def snap(tokens: list[int], nbytes: int = 100) -> KVSnapshot:
    return KVSnapshot(tuple(tokens), bytes(nbytes))


# -- the store -------------------------------------------------------------------------------
def test_lookup_finds_the_longest_shared_prefix_of_the_scope() -> None:
    store = PromptCache(10_000, min_prefix=4)
    store.put("a", snap(list(range(20))))
    store.put("a", snap(list(range(8)) + [99] * 20))
    store.put("b", snap(list(range(30))))
    found, n = store.lookup("a", list(range(12)) + [7])
    assert found is not None and found.tokens == tuple(range(20)) and n == 12
    assert store.lookup("a", [5, 6, 7, 8, 9]) == (None, 0)  # nothing shared from the start
    assert store.lookup("a", [0, 1, 2, 5]) == (None, 0)  # shorter than min_prefix
    found, n = store.lookup("c", list(range(30)))  # another key's states are never returned
    assert found is None and n == 0
    assert store.stats().hits == 1 and store.stats().misses == 3


def test_lru_eviction_by_bytes() -> None:
    store = PromptCache(300, min_prefix=1)
    for i in range(3):
        assert store.put("k", snap([i] * 5, 100))
    store.lookup("k", [0] * 5)  # the oldest becomes the most recent
    assert store.put("k", snap([3] * 5, 150))  # needs 150 of 300: drops [1] then [2]
    kept = {s.tokens[0] for s in store.scoped("k")}
    assert kept == {0, 3} and store.bytes == 250 and store.stats().evicted == 2
    assert not store.put("k", snap([4] * 5, 301))  # larger than the whole store: not kept, nothing evicted
    assert len(store) == 2


def test_a_longer_state_replaces_its_prefixes() -> None:
    store = PromptCache(10_000, min_prefix=1)
    store.put("k", snap([1, 2, 3]))
    store.put("j", snap([1, 2, 3]))
    store.put("k", snap([1, 2, 3, 4, 5]))
    assert [s.tokens for s in store.scoped("k")] == [(1, 2, 3, 4, 5)]
    assert len(list(store.scoped("j"))) == 1  # another scope's entry stays
    assert store.covers("k", [1, 2, 3, 4]) and not store.covers("k", [1, 2, 3, 4, 5, 6])
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_alternating_conversations_reuse_their_prefixes() -> None:
    eng = FakeEngine()
    reuse = PrefixReuse(eng, PromptCache(1 << 20, min_prefix=4))
    system = list(range(100))
    a1, b1 = system + [1000, 1001], system + [2000, 2001]
    assert reuse.prepare("k", a1) == 0
    eng.run(a1, [7, 8, 9])
    assert reuse.prepare("k", b1) == len(system)  # the live state shares the system prompt; A is stored
    eng.run(b1, [5, 6])
    a2 = a1 + [7, 8, 9, 1002]
    assert reuse.prepare("k", a2) == len(a1) + 2  # A restored: its prompt and the reply's decoded tokens
    eng.run(a2, [3, 3])
    b2 = b1 + [5, 6, 2002]
    assert reuse.prepare("k", b2) == len(b1) + 1
    assert eng.restores == 2 and reuse.store is not None and reuse.store.hits == 2


def test_states_never_cross_api_keys() -> None:
    """With several keys, each request's live state is stored when it is over (done(), on its own key's time):
    a switch only empties the live state, whatever it held."""
    eng = FakeEngine()
    reuse = PrefixReuse(eng, PromptCache(1 << 20, min_prefix=4), keep_live=True)
    prompt = list(range(50))
    reuse.prepare("alice", prompt)
    eng.run(prompt, [1, 2])
    reuse.done()
    snapshots = eng.snapshots
    assert reuse.prepare("bob", prompt) == 0 and eng.kv == []  # the live state was alice's: emptied
    assert eng.snapshots == snapshots  # and not stored then: the switch does no work that depends on it
    eng.run(prompt, [1, 2])
    reuse.done()
    assert reuse.prepare("alice", prompt) == len(prompt) - 1  # alice's own stored state
    assert reuse.prepare("mallory", prompt) == 0


def test_a_key_switch_without_keep_live_drops_the_live_state() -> None:
    eng = FakeEngine()
    reuse = PrefixReuse(eng, PromptCache(1 << 20, min_prefix=4))
    prompt = list(range(50))
    reuse.prepare("alice", prompt)
    eng.run(prompt, [1, 2])
    reuse.done()
    assert reuse.prepare("bob", prompt) == 0 and eng.snapshots == 0
    assert reuse.prepare("alice", prompt) == 0  # nothing was kept of it


def test_without_a_store_only_the_live_state_is_reused() -> None:
    eng = FakeEngine()
    reuse = PrefixReuse(eng, None)
    reuse.prepare("", [1, 2, 3, 4, 5])
    eng.run([1, 2, 3, 4, 5], [6])
    assert reuse.prepare("", [1, 2, 3, 9]) == 3 and eng.snapshots == 0


# -- tool calls ------------------------------------------------------------------------------
def run_scanner(pieces: list[str]) -> list[Any]:
    scanner = ToolCallScanner()
    out: list[Any] = []
    for p in pieces:
        out += scanner.push(p)
    return out + scanner.flush()


def test_scanner_splits_text_and_calls_across_pieces() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>\nDone'
    for cut in (1, 3, 7):
        events = run_scanner([text[i:i + cut] for i in range(0, len(text), cut)])
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert [(c.name, c.arguments) for c in calls] == [("read", {"path": "a.py"})]
        assert "".join(e for e in events if isinstance(e, str)) == "Let me look.\n\nDone"
        assert all("<" not in e for e in events if isinstance(e, str))  # no tag leaks as text


def test_scanner_gives_back_what_is_not_a_call() -> None:
    assert run_scanner(["a <tool", "_x> b"]) == ["a ", "<tool_x> b"]
    bad = "<tool_call>{not json}</tool_call>"
    assert "".join(run_scanner([bad])) == bad
    assert run_scanner(['<tool_call>{"name": "f", "arguments": {}}'])[0].name == "f"  # unclosed at the end
    text, calls = split_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                              '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]


# -- the chat template ------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read <a> & b",
                                          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def test_template_renders_tools_and_tool_turns() -> None:
    t = ChatTemplate(TOOL_TEMPLATE)
    assert t.supports_tools
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": {"path": "x"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "data"}]
    text = t.render(messages, TOOLS)
    assert text.startswith("<|im_start|>system\nS\n# Tools")
    assert json.dumps(TOOLS[0]) in text  # tojson without HTML escaping
    assert '<tool_call>\n{"name": "read", "arguments": {"path": "x"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\ndata\n</tool_response>\n<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_refusals_are_400s() -> None:
    t = ChatTemplate(TOOL_TEMPLATE)
    with pytest.raises(APIError) as exc:
        t.render([{"role": "assistant", "content": "first"}])
    assert exc.value.status == 400 and exc.value.code == "template_refused" and "user message" in exc.value.message
    plain = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert not plain.supports_tools and plain.render([{"role": "user", "content": "x"}]) == "user: x\n"
    with pytest.raises(APIError) as exc:
        plain.render([{"role": "user", "content": "x"}], TOOLS)
    assert exc.value.code == "tools_unsupported" and "tools" in exc.value.message
    assert load_template("{% for %}") is None and load_template(None) is None  # not compilable: llama.cpp's


# -- Anthropic ---------------------------------------------------------------------------------
def test_anthropic_messages_become_template_messages() -> None:
    req = ant.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}], "unknown_field": 1,
        "tools": [{"name": "read", "input_schema": {"type": "object"}},
                  {"type": "web_search_20250305", "name": "web_search"}],  # a server tool: left out
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "R"}]},
                                         {"type": "text", "text": "go on"}]}]})
    assert req.chat_messages() == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read", "arguments": {"p": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "R"}, {"role": "user", "content": "go on"}]
    assert req.template_tools() == [{"type": "function", "function": {"name": "read", "description": "",
                                                                      "parameters": {"type": "object"}}}]
    image = ant.MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert image.chat_messages() == [{"role": "user", "content": IMAGE_PLACEHOLDER}]  # no vision: a placeholder
    assert image.notes() and "1 image" in image.notes()[0]
    audio = ant.MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "audio", "source": {}}]}]})
    with pytest.raises(APIError) as exc:
        audio.chat_messages()
    assert exc.value.status == 400 and "audio" in exc.value.message


def parse_events(stream: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in stream.strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_anthropic_stream_events_in_order() -> None:
    r = ant.MessageReply("m")
    call = ToolCall("read", {"p": 1}, id="toolu_1")
    out = Outcome("tool_calls", 10, 4, {}, cached_tokens=6)
    events = parse_events(r.start(10, 6) + r.text("a") + r.text("b") + r.tool_use(call) + r.end(out))
    assert [e for e, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "content_block_start",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 4, "output_tokens": 0,
                                                "cache_read_input_tokens": 6, "cache_creation_input_tokens": 0}
    assert [d["index"] for e, d in events if e.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1]
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"p": 1}'}
    assert events[8][1]["delta"]["stop_reason"] == "tool_use" and events[8][1]["usage"]["output_tokens"] == 4
    whole = ant.MessageReply("m").whole(["a", "b", call], Outcome("stop", 3, 2, {}, stop_sequence="X"))
    assert whole["content"] == [{"type": "text", "text": "ab"},
                                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"p": 1}}]
    assert whole["stop_reason"] == "stop_sequence" and whole["stop_sequence"] == "X"


def test_no_event_within_the_interval_is_a_ping() -> None:
    import asyncio

    from edgemoe.runtime.sampling import GREEDY
    from edgemoe.serve.app import _next
    from edgemoe.serve.worker import Job

    async def run() -> list[tuple[str, Any]]:
        job = Job(asyncio.get_running_loop(), 4, GREEDY)
        first = await _next(job, 0.01)
        job.emit("delta", "x")
        return [first, await _next(job, 5.0)]

    assert asyncio.run(run()) == [("ping", None), ("delta", "x")]


def test_errors_take_the_shape_of_the_path() -> None:
    err = APIError(503, "busy", code="queue_full")
    assert json.loads(err.response("/v1/chat/completions").body)["error"]["code"] == "queue_full"
    r = err.response("/v1/messages")
    assert r.status_code == 529
    assert json.loads(r.body) == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert json.loads(APIError(413, "big").response("/v1/messages/count_tokens").body)["error"]["type"] == \
        "request_too_large"
