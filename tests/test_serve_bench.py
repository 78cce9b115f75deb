"""Benchmark (slow, prints, asserts no speed): the TTFT an agent sees when it alternates two conversations
that share a long system prompt, first turns against second turns (their prefixes restored from the
prompt cache). `pytest -m slow tests/test_serve_bench.py -s` prints the figures.
"""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from helpers.serve_harness import API_KEY, CTX, MODEL_ID, Server

SYSTEM = " ".join(f"Rule {i}: keep every module small, typed and tested; say why in one line."
                  for i in range(90))


def streamed_ttft(server: Server, messages: list[dict[str, str]]) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first text delta, the reply, the final usage) of one streamed Anthropic request."""
    body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "stream": True,
            "system": messages[0]["content"], "messages": messages[1:]}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    with httpx.stream("POST", f"{server.base_url}/messages", json=body, headers=headers, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta":
                ttft = ttft or time.perf_counter() - t0
                text.append(event["delta"]["text"])
            elif event["type"] == "message_delta":
                usage = event["usage"]
    return ttft, "".join(text), usage


@pytest.mark.slow
def test_alternating_conversations_ttft(server: Server) -> None:
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in ("Refactor the parser.", "Write the tests for it.")]
    rows = []
    for turn in (1, 2):
        for name, conv in zip("AB", convs, strict=False):
            ttft, reply, usage = streamed_ttft(server, conv)
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            rows.append((f"{name}{turn}", ttft, prompt, usage["cache_read_input_tokens"]))
            conv += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"And turn {turn + 1}?"}]
    assert rows[2][3] >= rows[0][2] - 1 and rows[3][3] >= rows[1][2] - 1  # second turns reused their prefixes
    print(f"\nalternating conversations on {MODEL_ID} (context {CTX}):")
    for name, ttft, prompt, cached in rows:
        print(f"  {name}: prompt {prompt} tokens, {cached} cached, TTFT {ttft * 1e3:.0f} ms")
    # A1 is the one cold prompt (B1 shares the system prompt with the live state A1 left)
    print("  TTFT / A1's: " + ", ".join(f"{name} {ttft / rows[0][1]:.3f}" for name, ttft, _, _ in rows[1:]))
