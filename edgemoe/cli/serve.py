"""edgemoe serve: the OpenAI-compatible HTTP server (edgemoe.serve) behind the chat command's options."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import click

from ..placement import CacheRequest
from .cache_options import cache_options
from .model import BUNDLED_MODEL, _open_engine
from .options import RunOptions, gating_options, run_options
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
        raise click.ClickException(f"cannot listen on {host}:{port}: {err.strerror}; "
                                   "pick another --port (0 picks a free one)") from err
    return sock


@click.command()
@click.argument("model", type=GGUFPath(), required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; the default accepts connections from this machine only "
                   "(0.0.0.0 opens it to the network: set --api-key then)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="TCP port (0: a free one, printed at start)")
@click.option("--api-key", envvar="EDGEMOE_API_KEY", default=None,
              help="require `Authorization: Bearer KEY` on /v1/ (env EDGEMOE_API_KEY)")
@click.option("--model-id", default=None, help="the model's name in /v1/models (default: the file name)")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="requests that may wait for the engine; more are answered 503")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="reply length when a request gives no max_tokens")
@run_options
@gating_options
@cache_options
def serve(model: Path | None, host: str, port: int, api_key: str | None, model_id: str | None, max_queue: int,
          max_tokens: int, run: RunOptions, gating: Any, cache: CacheRequest) -> None:
    """Serve a model over the OpenAI API (default: the bundled fixture), on localhost by default.

    Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (stream or not),
    GET /health. Requests run one at a time on one engine, first come first served; the sampling
    options are the defaults for requests that leave them out.
    """
    try:
        import uvicorn

        from ..serve.app import ServerConfig, create_app
        from ..serve.worker import EngineWorker
    except ImportError as err:
        raise click.ClickException(f"{INSTALL_HINT} ({err})") from err

    if model is None:
        model = GGUFPath().convert(os.environ.get("EDGEMOE_MODEL", str(BUNDLED_MODEL)), None, None)
    with _open_engine(model, run, cache, gating) as engine:
        config = ServerConfig(model_id=model_id or model.name.removesuffix(".gguf"), sampling=run.sampling,
                              max_tokens=max_tokens, api_key=api_key)
        worker = EngineWorker(engine, max_queue)
        sock = _bind(host, port)
        bound = sock.getsockname()[1]
        server: Any = uvicorn.Server(uvicorn.Config(create_app(worker, config), log_level="info",
                                                    timeout_graceful_shutdown=5))
        worker.start()
        click.echo(f"edgemoe serve: {config.model_id} (context {engine.n_ctx}) on http://{host}:{bound}/v1"
                   + (" (API key required)" if api_key else ""), err=True)
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()
            sock.close()
