"""A logging reverse proxy between a coding agent and `edgemoe serve`: it records each request (and what the
server answered) as a numbered JSON file, so that a real client's request shapes can be kept as test data.

    python tools/agent_proxy.py --upstream http://127.0.0.1:8080 --port 8081 --record /tmp/agent-session
    ANTHROPIC_BASE_URL=http://127.0.0.1:8081 claude -p "..."

Secrets are not written: authorization headers and API keys are replaced by "<redacted>". Bodies are kept as
JSON; responses (streamed ones included) are kept as text beside them (NNN-response.txt).
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def redacted_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def build_app(upstream: str, record: Path) -> Starlette:
    record.mkdir(parents=True, exist_ok=True)
    counter = itertools.count(len(list(record.glob("*-request.json"))))
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))

    async def forward(request: Request) -> Response:
        n = next(counter)
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw.decode(errors="replace")
        entry = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": redacted_headers(dict(request.headers)),
            "body": body,
        }
        (record / f"{n:03d}-request.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        up = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=raw
        )
        resp = await client.send(up, stream=True)
        out = (record / f"{n:03d}-response.txt").open("w")
        out.write(f"{resp.status_code}\n")

        async def relay():  # type: ignore[no-untyped-def]
            try:
                async for chunk in resp.aiter_raw():
                    out.write(chunk.decode(errors="replace"))
                    out.flush()
                    yield chunk
            finally:
                out.close()
                await resp.aclose()

        kept = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=resp.status_code, headers=kept)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081, help="0: a free one (printed at start)")
    parser.add_argument("--record", type=Path, required=True, help="directory for the recorded requests")
    args = parser.parse_args()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(
        f"agent_proxy: listening on http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True
    )
    config = uvicorn.Config(build_app(args.upstream, args.record), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
