"""A real `edgemoe serve` subprocess on a free port, for the server tests.

The module-scoped `server` fixture (registered in tests/conftest.py: a test takes it by name) starts one
process per test module (the bundled qwen3moe fixture, --ctx CTX, --api-key API_KEY, --max-queue 8).
`tool_model` writes a copy of the fixture whose chat template (TOOL_TEMPLATE, Qwen3/Hermes style)
renders tools and refuses a conversation that does not start with a user message. chat_reference is what
the engine itself answers, to compare the server's replies with.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from helpers.models import ROOT

if TYPE_CHECKING:
    from edgemoe import Engine

MODEL = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
MODEL_ID = MODEL.name.removesuffix(".gguf")
API_KEY = "test-key"
CTX = 4096
MAX_QUEUE = 8
THREADS = 1  # the CPU may be shared: more threads than free cores make llama.cpp crawl


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = API_KEY, **kw: object):  # type: ignore[no-untyped-def]
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def anthropic(self, api_key: str = API_KEY, **kw: object):  # type: ignore[no-untyped-def]
        import anthropic

        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{self.port}", api_key=api_key, max_retries=0,
                                   **kw)

    def health(self, api_key: str | None = API_KEY) -> dict[str, object]:
        """/health as a key holder sees it (queue, the key's prompt-cache figures); None: as anyone does."""
        headers = {"x-api-key": api_key} if api_key is not None else {}
        return httpx.get(f"http://127.0.0.1:{self.port}/health", headers=headers, timeout=5).json()

    def raw(self, request: bytes, *, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """Send request bytes on a fresh connection; (status, headers, body) of the answer, read until the
        server closes the connection (socket.timeout after timeout seconds of silence)."""
        out = b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(request)
            while chunk := sock.recv(1 << 16):
                out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        return int(status_line.split()[1]), headers, body

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def alive(self) -> bool:
        return self.proc.poll() is None


TOOL_TEMPLATE = """{%- set first = messages[0] if messages else none -%}
{%- if first is not none and first.role == 'system' or tools -%}
<|im_start|>system
{% if first is not none and first.role == 'system' %}{{ first.content }}{% endif %}
{%- if tools %}

# Tools

Call functions to help with the user's request. Their signatures, in <tools></tools> tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call one, answer with a JSON object in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif %}<|im_end|>
{% endif -%}
{%- set rest = messages[1:] if first is not none and first.role == 'system' else messages -%}
{%- if rest and rest[0].role != 'user' -%}
{{ raise_exception('the conversation must start with a user message (after the system prompt)') }}
{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'system' -%}
{{ raise_exception('a system message may only come first') }}
{%- elif m.role == 'tool' -%}
{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ m.content }}
</tool_response>
{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif %}
{%- else -%}
<|im_start|>{{ m.role }}
{{ m.content }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def tool_model(directory: Path) -> Path:
    """A copy of the fixture GGUF with TOOL_TEMPLATE as its chat template."""
    from gguf import GGUFValueType

    from helpers.gguf_mutate import GgufFile

    out = directory / "edgemoe-tiny-qwen3moe-tools.gguf"
    return GgufFile.read(MODEL).set("tokenizer.chat_template", GGUFValueType.STRING, TOOL_TEMPLATE).write(out)


def start_server(log: Path, *extra: str, model: Path = MODEL, api_key: bool = True,
                 max_files: int | None = None) -> Server:
    """api_key=False: a server without a key (the documented localhost default); max_files: the server's
    RLIMIT_NOFILE, soft and hard (1024 is the usual soft limit)."""
    key = ["--api-key", API_KEY] if api_key else []
    cmd = [sys.executable, "-m", "edgemoe", "serve", str(model), "--port", "0", "--ctx", str(CTX),
           *key, "--max-queue", str(MAX_QUEUE), "-t", str(THREADS), *extra]

    def limit_files() -> None:
        if max_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))

    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
                                preexec_fn=limit_files)
    deadline = time.monotonic() + 60
    port = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            port = int(m.group(1))
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
                return Server(proc, port, log)
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"edgemoe serve did not start (port {port}):\n{log.read_text(errors='replace')}")


def stop_server(server: Server) -> str:
    """SIGTERM (uvicorn's graceful shutdown); the server's log."""
    if server.alive():
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.log.read_text(errors="replace")


@contextmanager
def running(log: Path, *extra: str, model: Path = MODEL, api_key: bool = True,
            max_files: int | None = None) -> Iterator[Server]:
    """A server for the block; afterwards its log must show no traceback and no hanging handler."""
    srv = start_server(log, *extra, model=model, api_key=api_key, max_files=max_files)
    try:
        yield srv
    finally:
        text = stop_server(srv)
    assert "Traceback" not in text, text[-4000:]
    assert "graceful shutdown exceeded" not in text, text[-4000:]  # no request handler left hanging


def chat_reference(engine: Engine, messages: list[dict[str, str]], n: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) as ChatSession.send / generate --temp 0 make them."""
    # imported here: this module is a plugin of every test run, and these load llama.cpp
    from edgemoe import GREEDY
    from edgemoe.runtime.chat import ChatMessage

    prompt = engine.format_chat([ChatMessage(m["role"], m["content"]) for m in messages])
    g = engine.generate(prompt, max_tokens=n, sampling=GREEDY, parse_special=True)
    return g.text, len(g.tokens), "stop" if g.stop_reason == "eog" else "length"


def long_stream(server: Server, started: threading.Event, stop: threading.Event) -> None:
    """A completion streamed to CTX - 16 tokens; `started` once some lines came, closed mid-stream at `stop`."""
    body = {"model": MODEL_ID, "prompt": "ROMEO:", "max_tokens": CTX - 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 3:
                started.set()
            if stop.is_set():
                return  # leaving the block closes the connection mid-stream


def wait_idle(server: Server, timeout: float) -> float:
    """Seconds until the server is neither busy nor queueing; AssertionError after timeout seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        h = server.health()
        if not h["busy"] and h["queued"] == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"the engine is still busy after {timeout} s: {server.health()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("serve") / "server.log") as srv:
        yield srv
