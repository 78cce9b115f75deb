"""Soak: 200 mixed requests against one `edgemoe serve` process; latency percentiles, flat RSS.

Marked slow (not in the default run): `pytest -m slow tests/test_serve_soak.py -s` prints the figures.
"""
from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from helpers.serve_harness import API_KEY, MODEL_ID, Server

N_REQUESTS = 200
WARMUP = 20
CLIENTS = 4
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["ROMEO:", "JULIET:", "def main():\n", "First Citizen:\nBefore we proceed", "import os\n"]


def _request(server: Server, i: int) -> tuple[str, float, int]:
    """One request of kind i % 8; (kind, seconds, HTTP status)."""
    rnd = random.Random(i)
    kind = ("chat", "chat-stream", "text", "text-stream", "stop", "sampled", "error", "disconnect")[i % 8]
    prompt = rnd.choice(PROMPTS)
    body: dict[str, Any] = {"model": MODEL_ID, "max_tokens": rnd.randint(8, 64), "temperature": 0}
    if kind.startswith("chat"):
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/completions", prompt
    body["stream"] = kind.endswith("stream") or kind == "disconnect"
    if kind == "stop":
        body["stop"] = ["\n\n", "sir"]
    if kind == "sampled":
        body.update(temperature=0.9, top_p=0.9, seed=i)
    if kind == "error":
        body["model"] = "no-such-model"
    if kind == "disconnect":
        body["max_tokens"] = 2000
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if kind == "disconnect" and n >= 4:
                break
        return kind, time.perf_counter() - t0, r.status_code


@pytest.mark.slow
def test_soak_mixed_requests(server: Server) -> None:
    rss: list[tuple[int, int]] = []
    results: list[tuple[str, float, int]] = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        for start in range(0, N_REQUESTS, WARMUP):
            results += pool.map(lambda i: _request(server, i), range(start, start + WARMUP))
            rss.append((start + WARMUP, server.rss_kib()))
    assert server.alive() and server.health()["status"] == "ok"
    want = {"error": 404}
    bad = [r for r in results if r[2] != want.get(r[0], 200)]
    assert not bad, bad
    lat = sorted(s for kind, s, _ in results if kind not in ("error", "disconnect"))
    q = statistics.quantiles(lat, n=100)
    print(f"\nsoak: {len(results)} requests by {CLIENTS} clients; latency of the {len(lat)} complete replies: "
          f"p50 {q[49] * 1000:.0f} ms, p90 {q[89] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms, "
          f"max {lat[-1] * 1000:.0f} ms")
    print("soak: server RSS (MiB) after requests " +
          ", ".join(f"{n}: {kib / 1024:.1f}" for n, kib in rss))
    growth = rss[-1][1] - rss[0][1]
    assert growth < 16 * 1024, f"RSS grew by {growth / 1024:.1f} MiB after warm-up: {rss}"
