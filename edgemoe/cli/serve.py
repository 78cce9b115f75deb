"""edgemoe serve: the OpenAI- and Anthropic-compatible HTTP server (edgemoe.serve) behind the chat command's
options."""

from __future__ import annotations

import json
import os
import socket
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
    help="seconds a request body may take to arrive (llama-server's default); slower ones are answered 408",
)
@click.option(
    "--scripted-replies",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    hidden=True,
    help="tests: a JSON list of replies given in order instead of sampled ones",
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
        import uvicorn

        from ..runtime.prompt_cache import PromptCache, default_capacity
        from ..serve.app import DrainingServer, ServerConfig, create_app
        from ..serve.template import load_template
        from ..serve.worker import EngineWorker
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
        )
        bos, eos = engine.template_tokens()
        template = load_template(engine.chat_template(), bos_token=bos, eos_token=eos)
        capacity = default_capacity() if prompt_cache_mib is None else prompt_cache_mib << 20
        store = PromptCache(capacity) if capacity else None
        worker = EngineWorker(
            engine,
            max_queue,
            template=template,
            prompt_cache=store,
            scripted=_read_script(scripted_replies) if scripted_replies else None,
        )
        sock = _bind(host, port)
        bound = sock.getsockname()[1]
        server: Any = DrainingServer(
            uvicorn.Config(create_app(worker, config), log_level="info", timeout_graceful_shutdown=5), worker
        )
        worker.start()
        tools = "tools" if template is not None and template.supports_tools else "no tools"
        prompts = f"prompt cache {capacity >> 20} MiB" if store is not None else "no prompt cache"
        kv = engine.config
        attention = f"flash attention {engine.flash_attn}, KV cache K {kv.cache_type_k} V {kv.cache_type_v}"
        click.echo(
            f"edgemoe serve: {config.model_id} (context {engine.n_ctx}, {attention}, {tools}, {prompts}) on "
            f"http://{host}:{bound}/v1" + (" (API key required)" if keys else ""),
            err=True,
        )
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()
            sock.close()


def _read_script(path: Path) -> list[str]:
    replies = json.loads(path.read_text())
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        raise click.ClickException(f"{path}: give a JSON list of strings (the replies, in order)")
    return replies
