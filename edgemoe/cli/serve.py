"""edgemoe serve: the OpenAI- and Anthropic-compatible HTTP server (edgemoe.serve) behind the chat command's
options."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from ..plan.request import CacheRequest
from .cache_options import cache_options
from .model import BUNDLED_MODEL, _open_engine
from .options import RunOptions, gating_options, run_options, speculation_options
from .types import GGUFPath

INSTALL_HINT = "install the server extra: pip install 'edgemoe[serve]'"


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as err:
        sock.close()
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {err.strerror}; pick another --port (0 picks a free one)"
        ) from err
    return sock


@click.command()
@click.argument("model", type=GGUFPath(), required=False)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="address to listen on; the default accepts connections from this machine only "
    "(0.0.0.0 opens it to the network: set --api-key then)",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="TCP port (0: a free one, printed at start)",
)
@click.option(
    "--api-key",
    "api_keys",
    envvar="EDGEMOE_API_KEY",
    multiple=True,
    help="require this key on /v1/, as `Authorization: Bearer KEY` or `x-api-key: KEY` "
    "(repeatable: each key's cached prompts stay its own; env EDGEMOE_API_KEY, keys separated "
    "by spaces)",
)
@click.option("--model-id", default=None, help="the model's name in /v1/models (default: the file name)")
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="requests that may wait for the engine; more are answered 503 (Anthropic API: 529)",
)
@click.option(
    "--prompt-cache-mib",
    type=click.IntRange(min=0),
    default=None,
    help="host memory for the KV states of recent prompts, reused by requests sharing their prefix "
    "[default: a quarter of the available memory, at most 8 GiB; 0: off]",
)
@click.option(
    "--max-body-mib",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="larger request bodies are answered 413",
)
@click.option(
    "--read-timeout",
    "read_timeout_s",
    type=click.FloatRange(min=0.1),
    default=600.0,
    show_default=True,
    help="seconds a request body may take to arrive (llama-server's default; slower ones are answered 408), "
    "and a client may go without reading any of a response (then it is disconnected)",
)
@click.option(
    "--max-bodies-mib",
    type=click.IntRange(min=1),
    default=None,
    help="request bodies held at once while they arrive, over all connections; past it 503 (Anthropic "
    "API: 529)  [default: 8 x --max-body-mib]",
)
@click.option(
    "--header-timeout",
    "header_timeout_s",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="seconds a request's line and headers may take to arrive (from the connection's start or the previous "
    "response's end); slower or idle connections are closed",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="connections open at once (fewer where the limit of open files is lower); past it the connection "
    "idle the longest is closed",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="a Host name to answer without --api-key, besides localhost, loopback addresses and --host "
    "(repeatable; with --api-key any Host is answered)",
)
@click.option(
    "--scripted-replies",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    hidden=True,
    help="tests: a JSON list of replies given instead of sampled ones (strings in order, or "
    '{"when": REGEX, "reply": TEXT} for a prompt REGEX matches)',
)
@click.option(
    "-n",
    "--max-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="reply length when a request gives no max_tokens",
)
@run_options
@gating_options
@cache_options
@speculation_options
def serve(
    model: Path | None,
    host: str,
    port: int,
    api_keys: tuple[str, ...],
    model_id: str | None,
    max_queue: int,
    prompt_cache_mib: int | None,
    max_body_mib: int,
    read_timeout_s: float,
    max_bodies_mib: int | None,
    header_timeout_s: float,
    max_connections: int,
    allowed_hosts: tuple[str, ...],
    scripted_replies: Path | None,
    max_tokens: int,
    run: RunOptions,
    gating: Any,
    cache: CacheRequest,
    speculation: Any,
) -> None:
    """Serve a model over the OpenAI and Anthropic APIs (default: the bundled fixture; on localhost by default).

    Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (stream or
    not; tools through the model's chat template), POST /v1/messages/count_tokens, GET /health. Requests run
    one at a time on one engine, first come first served; prompts sharing a prefix with a recent one reuse
    its KV state. The sampling options are the defaults for requests that leave them out.
    """
    try:
        import uvicorn  # noqa: F401  # the extra's check (the server is built by _http_server)

        from ..serve.app import ServerConfig
        from ..serve.front import HostPolicy
        from ..serve.transport import TransportLimits
    except ImportError as err:
        raise click.ClickException(f"{INSTALL_HINT} ({err})") from err

    if model is None:
        model = GGUFPath().convert(os.environ.get("EDGEMOE_MODEL", str(BUNDLED_MODEL)), None, None)
    with _open_engine(model, run, cache, gating, speculation) as engine:
        keys = tuple(k for key in api_keys for k in key.split())
        config = ServerConfig(
            model_id=model_id or model.name.removesuffix(".gguf"),
            sampling=run.sampling,
            max_tokens=max_tokens,
            api_keys=keys,
            max_body_bytes=max_body_mib << 20,
            read_timeout_s=read_timeout_s,
            max_bodies_bytes=(max_bodies_mib or 8 * max_body_mib) << 20,
            hosts=HostPolicy(bound=host, names=allowed_hosts),
        )
        limits = TransportLimits(header_timeout_s, max_connections, write_timeout_s=read_timeout_s)
        worker = _worker(engine, max_queue, prompt_cache_mib, len(keys), scripted_replies)
        sock = _bind(host, port)
        bound = sock.getsockname()[1]
        server = _http_server(worker, config, limits)
        worker.start()
        click.echo(
            f"edgemoe serve: {config.model_id} ({_what_it_serves(engine, worker.template, worker.reuse.store)}) on "
            f"http://{host}:{bound}/v1" + (" (API key required)" if keys else ""),
            err=True,
        )
        if engine.n_ctx < AGENT_CTX:
            click.echo(f"warning: {agent_context_warning(engine.n_ctx)}", err=True)
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()
            sock.close()


AGENT_CTX = 32768  # the smallest context that holds a coding agent's fixed prompt and a working conversation


def agent_context_warning(n_ctx: int) -> str:
    return (
        f"the context holds {n_ctx} tokens: coding agents' fixed prompts (system prompt and tools) alone take "
        "14K (OpenCode) to 28K (Qwen Code) tokens, and below that they fail or loop on compaction; give "
        f"--ctx {AGENT_CTX} or more for them (docs/serve.md, 'Coding agents')"
    )


def _worker(
    engine: Any, max_queue: int, prompt_cache_mib: int | None, n_keys: int, script: Path | None
) -> Any:
    """The engine thread, with the model's chat template and the prompt cache (`prompt_cache_mib` None: the
    default capacity; 0: none)."""
    from ..runtime.prompt_cache import PromptCache, default_capacity
    from ..serve.template import load_template
    from ..serve.worker import EngineWorker

    bos, eos = engine.template_tokens()
    capacity = default_capacity() if prompt_cache_mib is None else prompt_cache_mib << 20
    return EngineWorker(
        engine,
        max_queue,
        template=load_template(engine.chat_template(), bos_token=bos, eos_token=eos),
        prompt_cache=PromptCache(capacity) if capacity else None,
        keep_live=n_keys > 1,  # a key switch then does no work that depends on the other key's state
        scripted=_read_script(script) if script else None,
    )


def _what_it_serves(engine: Any, template: Any, store: Any) -> str:
    """The start line's middle: the context, attention and KV types, tools, the prompt cache."""
    kv = engine.config
    tools = "tools" if template is not None and template.supports_tools else "no tools"
    prompts = f"prompt cache {store.capacity_bytes >> 20} MiB" if store is not None else "no prompt cache"
    return (
        f"context {engine.n_ctx}, flash attention {engine.flash_attn}, KV cache K {kv.cache_type_k} "
        f"V {kv.cache_type_v}, {tools}, {prompts}"
    )


def _http_server(worker: Any, config: Any, limits: Any) -> Any:
    """uvicorn's server of the app, its connections held to `limits` (the connection cap fitted to the limit of
    open files, said when that lowers it)."""
    import uvicorn

    from ..serve.app import DrainingServer, create_app
    from ..serve.transport import BACKLOG, fit_connections, protocol_class

    fitted = fit_connections(limits.max_connections)
    if fitted < limits.max_connections:
        click.echo(
            f"note: at most {fitted} connections at once (the limit of open files, `ulimit -n`, is lower than "
            f"--max-connections {limits.max_connections} needs)",
            err=True,
        )
    uv_config = uvicorn.Config(
        create_app(worker, config),
        http=protocol_class(replace(limits, max_connections=fitted)),
        backlog=BACKLOG,
        timeout_keep_alive=max(1, int(limits.header_timeout_s)),
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(uv_config, worker)


def _read_script(path: Path) -> Any:
    from ..serve.scripted import Script

    return Script.read(path)
