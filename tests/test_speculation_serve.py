"""`edgemoe serve --speculate lookup`: replies verified in batches equal the engine's greedy ones, the response
says what speculation did, and a request's `"speculate": false` turns it off (OpenAI and Anthropic routes)."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from edgemoe import GREEDY, Engine, LoadConfig

from helpers.serve_harness import API_KEY, MODEL, MODEL_ID, Server, running

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft,"


@pytest.fixture(scope="module")
def lookup_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server speculating by prompt lookup (the harness's `server` does not speculate)."""
    with running(tmp_path_factory.mktemp("serve") / "server.log", "--speculate", "lookup", "--draft-max", "4") as srv:
        yield srv


def _post(server: Server, path: str, body: dict) -> dict:
    r = httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("speculate", [None, False])
def test_completions_with_and_without_speculation(lookup_server: Server, speculate: bool | None) -> None:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    if speculate is not None:
        body["speculate"] = speculate
    out = _post(lookup_server, "/v1/completions", body)
    with Engine(MODEL, LoadConfig(n_ctx=512, n_threads=1)) as eng:
        want = eng.generate(PROMPT, max_tokens=24, sampling=GREEDY).text
    assert out["choices"][0]["text"] == want
    spec = out["edgemoe"].get("speculation")
    if speculate is False:
        assert spec is None
    else:
        assert spec is not None and spec["mode"] == "lookup" and spec["steps"] > 0


def test_anthropic_messages_opt_out(lookup_server: Server) -> None:
    body = {"model": MODEL_ID, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "ROMEO: But soft, ROMEO: But soft,"}]}
    on = _post(lookup_server, "/v1/messages", body)
    off = _post(lookup_server, "/v1/messages", {**body, "speculate": False})
    assert on["content"] == off["content"]
    assert on["edgemoe"]["speculation"]["mode"] == "lookup" and "speculation" not in off["edgemoe"]


def test_a_bad_speculate_value_is_a_400(lookup_server: Server) -> None:
    r = httpx.post(f"http://127.0.0.1:{lookup_server.port}/v1/completions", headers={"x-api-key": API_KEY}, timeout=30,
                   json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "speculate": "yes"})
    assert r.status_code == 400, r.text


def test_mtp_heads_through_serve_and_its_prompt_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """--speculate mtp on a model with MTP heads: replies equal the same server's replies without speculation,
    also for prompts that reuse a KV prefix or a stored state (the MTP context follows the truncation and the
    restored state)."""
    from edgemoe.gguf.synth import write_synthetic

    tmp = tmp_path_factory.mktemp("serve-mtp")
    model = write_synthetic("tiny-deepseek2-mtp", tmp / "mtp.gguf", progress=False)
    # flash attention off: llama.cpp's CPU flash attention gives this MLA model's last prompt token other logits
    # (by 0.024) in a batch of 70 queries than alone, so a reused prefix flips near-ties with or without
    # speculation (docs/speculation.md, near-ties)
    args = ("--speculate", "mtp", "--draft-max", "3", "--flash-attn", "off")
    with running(tmp / "server.log", *args, model=model) as srv:
        for prompt in (PROMPT, PROMPT + " what light", PROMPT):
            body = {"model": model.stem, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            out = _post(srv, "/v1/completions", body)
            plain = _post(srv, "/v1/completions", {**body, "speculate": False})
            assert out["choices"][0]["text"] == plain["choices"][0]["text"]
            spec = out["edgemoe"]["speculation"]
            assert spec["mode"] == "mtp" and spec["steps"] > 0
