"""The agent TTFT replay (edgemoe.perf.agent_ttft) without a server: the recorded sessions load, each request is
sent warm in order then cold under its own key, asking for one token, and the turns' projection charges a warm
turn only for what it did not reuse."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edgemoe.analysis.routing_profile import routing_for_model
from edgemoe.perf.agent_ttft import TurnTTFT, load_session, one_token, project_turns, replay, usage
from edgemoe.perf.model.costmodel import ModelShape
from edgemoe.perf.model.prefill_plan import PrefillSpec
from edgemoe.perf.model.profile import load_profile

DATA = Path(__file__).parent / "data" / "agents"
FIXTURE = Path(__file__).parent.parent / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


@pytest.mark.parametrize("name, path, n", [("claude-code", "/v1/messages", 3), ("codex", "/v1/responses", 3),
                                           ("opencode", "/v1/chat/completions", 4),
                                           ("qwen-code", "/v1/chat/completions", 3)])
def test_recorded_sessions_load(name: str, path: str, n: int) -> None:
    s = load_session(DATA / f"{name}-session.json.xz")
    assert s.client == name and len(s.requests) == n and {r["path"] for r in s.requests} == {path}
    body = one_token(path, s.requests[0]["body"], "m")
    assert body["model"] == "m" and body["stream"] is False and "stream_options" not in body
    assert (body["max_output_tokens"] if path.endswith("responses") else body["max_tokens"]) == 1
    assert s.requests[0]["body"].get("stream") is True  # the recorded body is left as it was


class FakeServer:
    """Prompt tokens: the body's length; reuse: the common prefix with the key's previous body."""

    def __init__(self) -> None:
        self.last: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
        text = str(body["messages"])
        prev = self.last.get(key, "")
        shared = next((i for i, (a, b) in enumerate(zip(prev, text, strict=False)) if a != b), min(len(prev), len(text)))
        self.last[key] = text
        self.calls.append((key, text[:20]))
        return {"usage": {"prompt_tokens": len(text), "prompt_tokens_details": {"cached_tokens": shared}}}


def test_replay_warm_in_order_then_each_cold_alone() -> None:
    s = load_session(DATA / "opencode-session.json.xz")
    fake = FakeServer()
    turns = replay(s, fake, model="m", keys=["w", "c0", "c1", "c2", "c3"])
    assert [k for k, _ in fake.calls] == ["w", "w", "w", "w", "c0", "c1", "c2", "c3"]
    assert turns[0].reused_tokens == 0 and turns[2].reused_tokens > 0.9 * turns[1].prompt_tokens
    assert all(t.cold_s >= 0 and t.warm_s >= 0 for t in turns)
    with pytest.raises(ValueError):
        replay(s, fake, model="m", keys=["w"])
    with pytest.raises(RuntimeError):  # a "cold" key that reuses is no cold measurement
        replay(s, fake, model="m", keys=["w", "w", "w", "w", "w"])
    assert usage("/v1/messages", {"usage": {"input_tokens": 3, "cache_read_input_tokens": 7}}) == (10, 7)
    assert usage("/v1/responses", {"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}}) == (9, 4)


def test_a_warm_turn_is_projected_for_what_it_did_not_reuse() -> None:
    shape = ModelShape.read(FIXTURE)
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    turns = [TurnTTFT(0, "/v1/messages", 3000, 0, 0.0, 0.0), TurnTTFT(1, "/v1/messages", 3100, 3000, 0.0, 0.0),
             TurnTTFT(2, "/v1/messages", 3100, 0, 0.0, 0.0)]
    p = project_turns(turns, shape, trace, load_profile("rtx4060-laptop"), PrefillSpec(1 << 30, 4096))
    assert p[0].warm_stock_s == p[0].cold_stock_s  # nothing reused: the warm turn is the cold one
    # 100 new tokens in one ubatch against 3,100 in seven (the tiny fixture's ubatches cost mostly their launches)
    assert 0 < p[1].warm_edgemoe_s < 0.5 * p[1].cold_edgemoe_s and 0 < p[1].warm_stock_s < 0.5 * p[1].cold_stock_s
    assert p[1].cold_stock_s == p[2].cold_stock_s
