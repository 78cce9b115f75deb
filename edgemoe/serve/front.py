"""What every request must satisfy before any route, whatever its path (RFC 9112, RFC 9110):

- one Host header with a valid value (`host[:port]`, an IP literal in brackets); otherwise 400;
- without API keys, a Host naming this machine: `localhost` (and `*.localhost`), a loopback address, the
  address the server listens on (any IP address when that is a wildcard), or a name given with
  `--allowed-host`; otherwise 403. After a DNS rebinding, a web page reaches a local server under its own
  name, which it cannot help sending as Host: without this check it could drive the local model (as
  llama-server and ollama check);
- one body framing: `Content-Length` and `Transfer-Encoding` together are refused with a 400 and the
  connection closed (RFC 9112 §6.1), on every route, so that no byte after such a head is read as a request.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, echo

_HOST = re.compile(
    r"(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._~!$&'()*+,;=%-]*))(?::(?P<port>[0-9]*))?"
)
_IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_host(value: str) -> str | None:
    """The host a Host header names (lower case, without a trailing dot or an IPv6 literal's brackets); None
    when the value is not `uri-host [":" port]`."""
    m = _HOST.fullmatch(value)
    if m is None or (m["port"] and int(m["port"]) > 65535):
        return None
    if m["ip6"] is not None:
        try:
            return str(ipaddress.IPv6Address(m["ip6"]))
        except ValueError:
            return None
    return m["name"].lower().rstrip(".")


def _ip(host: str) -> _IP | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class HostPolicy:
    """Which Host values the server answers: any valid one with API keys, else only names of this machine."""

    bound: str = "127.0.0.1"  # the address the server listens on (--host)
    names: tuple[str, ...] = ()  # host names allowed besides (--allowed-host)
    any_host: bool = False  # the server asks for an API key: the key protects it, not the Host

    def allows(self, host: str) -> bool:
        if self.any_host or host == "localhost" or host.endswith(".localhost"):
            return True
        if host in (n.lower().rstrip(".") for n in (self.bound, *self.names)):
            return True
        ip, bound = _ip(host), _ip(self.bound)
        if ip is None:
            return False
        return ip.is_loopback or ip == bound or (bound is not None and bound.is_unspecified)


class FrontMiddleware:
    """The checks above, in each API's error shape; a refused request's connection is closed."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope["headers"])
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.response(scope["path"])
        response.headers["Connection"] = "close"  # the body (if any) is never read
        await response(scope, receive, send)

    def _refusal(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        names = {k for k, _ in headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            return APIError(
                400,
                "the request has both Content-Length and Transfer-Encoding; send one of them",
                code="invalid_framing",
            )
        hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
        if len(hosts) > 1:
            return APIError(400, "the request has more than one Host header; send one", code="invalid_host")
        if not hosts:  # HTTP/1.0 (HTTP/1.1 without Host never gets here)
            return None
        host = parse_host(hosts[0])
        if host is None:
            return APIError(
                400,
                f"the Host header {echo(hosts[0])} is not a host name or address with an optional port",
                code="invalid_host",
            )
        if not self.hosts.allows(host):
            return APIError(
                403,
                f"this server answers only Host names of this machine (localhost, {self.hosts.bound}), not "
                f"{echo(host)}: a web page could otherwise reach it through DNS rebinding. Use "
                "http://127.0.0.1:PORT, or start the server as `edgemoe serve MODEL --api-key KEY` (then any Host "
                "is answered) or `edgemoe serve MODEL --allowed-host NAME`",
                code="host_not_allowed",
            )
        return None
