"""Real coding agents against `edgemoe serve`: Claude Code, OpenCode, Qwen Code and Codex CLI, pinned from npm.

`pytest -m agents` (CI runs it after `make test`). The clients are installed once into $EDGEMOE_AGENT_CACHE
(default ~/.cache/edgemoe-agents, outside the repository) and reused; without node and npm, or without the
registry, the tests skip and say why.

Each client runs non-interactively, as its docs/serve.md setup block says, against the fixture with a
tool-calling template (tests/helpers/serve_harness.TOOL_TEMPLATE) at a 32K context, through tools/agent_proxy.py
(which records what the client sent and what the server answered). The tiny model cannot use tools, so scripted
replies (serve.scripted) play it: a tool call the client executes (reading README.md), then, once the file's
text is in the prompt, a final answer. The client must exit 0 with that answer. A second session (Claude Code)
or a continued one (the others) must then find at least 90% of the first prompt's tokens in the prompt cache.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.models import ROOT
from helpers.serve_harness import API_KEY, Server, running, tool_model

pytestmark = pytest.mark.agents

CACHE = Path(os.environ.get("EDGEMOE_AGENT_CACHE", Path.home() / ".cache" / "edgemoe-agents"))
CTX = 32768  # docs/serve.md's context for agents: their fixed prompts alone are 14-28K tokens
THREADS = "2"
MODEL_ID = "tiny"
README = "The marker of this project is PELICAN-42.\n"
ANSWER = "The README names the marker PELICAN-42."
AGAIN = "And once more"  # the second session's prompt
RUN_TIMEOUT_S = 1800  # a cold 28K-token prompt takes minutes on a busy 2-core CPU ...
SLOW_MS = "1800000"  # ... longer than the clients wait for a first token (docs/serve.md, "On a slow machine")


@dataclass(frozen=True)
class Client:
    name: str
    package: str  # npm name@version
    binary: str  # in node_modules/.bin
    call: str  # the tool call the scripted model makes, reading README.md ({path}: its absolute path)

    @property
    def directory(self) -> Path:
        return CACHE / self.package.replace("/", "+")

    @property
    def bin(self) -> Path:
        return self.directory / "node_modules" / ".bin" / self.binary


CLIENTS = {
    c.name: c
    for c in (
        Client("claude-code", "@anthropic-ai/claude-code@2.1.328", "claude", '{"name": "Read", "arguments": '
               '{"file_path": "{path}"}}'),
        Client("opencode", "opencode-ai@1.18.33", "opencode", '{"name": "read", "arguments": {"filePath": "{path}"}}'),
        Client("qwen-code", "@qwen-code/qwen-code@0.24.4", "qwen", '{"name": "read_file", "arguments": '
               '{"file_path": "{path}"}}'),
        Client("codex", "@openai/codex@0.169.0", "codex", '{"name": "exec_command", "arguments": {"cmd": '
               '"cat README.md"}}'),
    )
}


def install(client: Client) -> Path:
    """The client's executable, installed into the cache on first use; skips without node, npm or the registry."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("node and npm are needed to install the real clients (node 20 or newer)")
    stamp = client.directory / "installed"
    if client.bin.exists() and stamp.exists() and stamp.read_text() == client.package:
        return client.bin
    client.directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "npm_config_cache": str(CACHE / "npm")}
    cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(client.directory), client.package]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        view = subprocess.run([npm, "view", client.package, "version"], capture_output=True, text=True,
                              timeout=60, env=env)
        if view.returncode != 0:
            pytest.skip(f"the npm registry is not reachable ({view.stderr.strip()[-200:]})")
        pytest.fail(f"npm install {client.package} failed:\n{r.stderr[-2000:]}")
    stamp.write_text(client.package)
    return client.bin


# -- the server and the recorded exchange ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_model(tmp_path_factory.mktemp("agents-model"))


@dataclass
class Exchange:
    path: str
    prompt_tokens: int
    cached_tokens: int
    status: int


def exchanges(record: Path) -> list[Exchange]:
    """What each recorded request cost: its prompt's tokens and those found in the prompt cache."""
    out = []
    for f in sorted(record.glob("*-response.txt")):
        request = json.loads(f.with_name(f.name.replace("response.txt", "request.json")).read_text())
        text = f.read_text()
        status = int(text.split("\n", 1)[0])
        prompt = cached = 0
        for m in re.finditer(r'"prompt_tokens":(\d+).*?"cached_tokens":(\d+)', text):  # chat completions
            prompt, cached = int(m.group(1)), int(m.group(2))
        for m in re.finditer(r'"input_tokens":(\d+),"input_tokens_details":\{"cached_tokens":(\d+)', text):
            prompt, cached = int(m.group(1)), int(m.group(2))  # responses
        m = re.search(r'"input_tokens":(\d+),"output_tokens":\d+,"cache_read_input_tokens":(\d+)', text)
        if m and request["path"].startswith("/v1/messages"):  # messages: input_tokens are those evaluated
            prompt, cached = int(m.group(1)) + int(m.group(2)), int(m.group(2))
        out.append(Exchange(request["path"], prompt, cached, status))
    return out


@dataclass
class Setup:
    client: str
    server: Server
    proxy: str  # the base URL the client is pointed at (no /v1)
    record: Path
    project: Path
    home: Path


@pytest.fixture
def setup(tmp_path: Path, model: Path, request: pytest.FixtureRequest) -> Iterator[Setup]:
    client: Client = CLIENTS[request.param]
    install(client)
    project, home, record = tmp_path / "project", tmp_path / "home", tmp_path / "record"
    project.mkdir()
    home.mkdir()
    (project / "README.md").write_text(README)
    call = client.call.replace("{path}", str(project / "README.md"))
    script = [
        {"when": "title generator", "reply": "The README"},  # OpenCode's title request, beside the main one
        {"when": "title generator", "reply": "The README"},
        {"when": AGAIN, "reply": "Done again."},
        {"when": "PELICAN-42", "reply": ANSWER},  # the file's text came back: answer
        {"when": "README", "reply": f"<tool_call>\n{call}\n</tool_call>"},
    ]
    (tmp_path / "script.json").write_text(json.dumps(script))
    with running(tmp_path / "server.log", "--scripted-replies", str(tmp_path / "script.json"), "--ctx", str(CTX),
                 "-t", THREADS, "--model-id", MODEL_ID, model=model) as srv:
        log = (tmp_path / "proxy.log").open("wb")
        proxy = subprocess.Popen([sys.executable, str(ROOT / "tools" / "agent_proxy.py"), "--upstream",
                                  f"http://127.0.0.1:{srv.port}", "--port", "0", "--record", str(record)],
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            yield Setup(client.name, srv, _proxy_url(tmp_path / "proxy.log", proxy), record, project, home)
        finally:
            proxy.terminate()
            proxy.wait(10)
            log.close()


def _proxy_url(log: Path, proxy: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proxy.poll() is None:
        m = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
        time.sleep(0.1)
    raise RuntimeError(f"agent_proxy did not start:\n{log.read_text(errors='replace')}")


# -- each client as its docs/serve.md block sets it up ---------------------------------------------------
DOCS = ROOT / "docs" / "serve.md"
DOC_URL, DOC_MODEL = "http://127.0.0.1:8080", "qwen3-30b-a3b"  # what the blocks name


def setup_blocks(client: str, s: Setup) -> dict[str, str]:
    """The fenced blocks of the client's part of docs/serve.md ({language: text}), pointed at this test's
    server (through the proxy) and model."""
    text = DOCS.read_text()
    start = text.index(f"<!-- agent-setup: {client} -->")
    ends = [i for i in (text.find("<!-- agent-setup:", start + 1), text.find("\n#", start)) if i > 0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", text[start:min(ends)], re.S)
    return {lang: body.replace(DOC_URL, s.proxy).replace(DOC_MODEL, MODEL_ID) for lang, body in blocks}


def exports(sh: str) -> dict[str, str]:
    """The variables a block's `export NAME=VALUE` lines set ($EDGEMOE_API_KEY expanded)."""
    out = {}
    for m in re.finditer(r'^export (\w+)=(?:"([^"]*)"|(\S*))', sh, re.M):
        out[m.group(1)] = (m.group(2) if m.group(2) is not None else m.group(3)).replace("$EDGEMOE_API_KEY",
                                                                                          API_KEY)
    return out


def client_env(s: Setup, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "SSL_CERT_FILE")}
    return {**keep, "HOME": str(s.home), "XDG_CONFIG_HOME": str(s.home / ".config"),
            "XDG_DATA_HOME": str(s.home / ".local" / "share"), "XDG_CACHE_HOME": str(s.home / ".cache"),
            "npm_config_cache": str(CACHE / "npm"), "CI": "1", "EDGEMOE_API_KEY": API_KEY, **extra}


def run(s: Setup, cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=s.project, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{cmd[0]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def claude_code(s: Setup, prompt: str, *, again: bool) -> str:
    block = setup_blocks("claude-code", s)["sh"]
    env = client_env(s, DISABLE_AUTOUPDATER="1", API_TIMEOUT_MS=SLOW_MS, **exports(block))
    out = run(s, [str(CLIENTS["claude-code"].bin), "-p", prompt, "--output-format", "json"], env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["modelUsage"][MODEL_ID]["contextWindow"] == CTX  # the window the block tells it
    return str(result["result"])


def opencode(s: Setup, prompt: str, *, again: bool) -> str:
    (s.project / "opencode.json").write_text(setup_blocks("opencode", s)["json"])
    env = client_env(s, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                     OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_SHARE="1")
    cmd = [str(CLIENTS["opencode"].bin), "run", *(["-c"] if again else []), prompt]
    return run(s, cmd, env).stdout


def qwen_code(s: Setup, prompt: str, *, again: bool) -> str:
    blocks = setup_blocks("qwen-code", s)
    (s.home / ".qwen").mkdir(exist_ok=True)
    (s.home / ".qwen" / "settings.json").write_text(blocks["json"])
    env = client_env(s, QWEN_STREAM_IDLE_TIMEOUT_MS=SLOW_MS, QWEN_STREAM_MAX_LIFETIME_MS=SLOW_MS,
                     **exports(blocks["sh"]))
    cmd = [str(CLIENTS["qwen-code"].bin), *(["-c"] if again else []), "-p", prompt]
    return run(s, cmd, env).stdout


def codex(s: Setup, prompt: str, *, again: bool) -> str:
    codex_home = s.home / ".codex"
    codex_home.mkdir(exist_ok=True)
    config = setup_blocks("codex", s)["toml"]
    assert config.rstrip().endswith('wire_api = "responses"')  # the provider's table is last
    (codex_home / "config.toml").write_text(f"{config}stream_idle_timeout_ms = {SLOW_MS}\n")
    env = client_env(s, CODEX_HOME=str(codex_home))
    head = [str(CLIENTS["codex"].bin), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access"]
    return run(s, [*head, *(["resume", "--last"] if again else []), prompt], env).stdout


DRIVERS = {"claude-code": claude_code, "opencode": opencode, "qwen-code": qwen_code, "codex": codex}


@pytest.mark.parametrize("setup", list(CLIENTS), indirect=True)
def test_client_round_trip_and_reuse(setup: Setup) -> None:
    s = setup
    drive: Any = DRIVERS[s.client]
    assert ANSWER in drive(s, "What is in README.md?", again=False)
    first = exchanges(s.record)
    assert all(e.status == 200 for e in first), [vars(e) for e in first]
    main = [e for e in first if e.prompt_tokens > 4000]  # not OpenCode's title request
    assert len(main) >= 2 and main[1].cached_tokens >= main[0].prompt_tokens - 1  # the tool's result extends it
    assert "Done again." in drive(s, f"{AGAIN}: what is in README.md?", again=True)
    second = exchanges(s.record)[len(first):]
    assert second and all(e.status == 200 for e in second), [vars(e) for e in second]
    reused = max(e.cached_tokens for e in second)
    assert reused >= 0.9 * main[0].prompt_tokens, (s.client, [vars(e) for e in first + second])
