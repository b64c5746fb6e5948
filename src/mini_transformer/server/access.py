"""Who may use the server: the api key, and the names the server answers to.

The key: when the server has one, every /v1 and tokenizer route and /metrics need
`Authorization: Bearer KEY`; / (a static page that asks for the key) and /health stay open.

The Host check: a web page on any site can have its own DNS name rebound to 127.0.0.1 and then send
requests to a local server as its own origin (DNS rebinding). Such a request still carries the page's
name in its Host header, so the server answers only the names it goes by: localhost, 127.0.0.1, [::1],
the address it binds, and the names given with --allowed-hosts. Any other Host gets 421.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from .protocol import ErrorResponse

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})  # the names a loopback server always answers to
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})  # bind addresses that are no name of the server


def host_name(host_header: str) -> str:
    """A Host header's name, lower case, without its port: "[::1]:8000" -> "[::1]", "A.b:80" -> "a.b"."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.partition(":")[0]


def allowed_hosts(bind_host: str, extra_names=()) -> frozenset[str]:
    """The Host names a server bound to `bind_host` answers to: the loopback names, the bind address
    (unless it is a wildcard such as 0.0.0.0) and `extra_names`."""
    names = {host_name(_bracketed(n)) for n in (bind_host, *extra_names)}
    return LOCAL_HOSTS | (names - WILDCARD_HOSTS)


def _bracketed(name: str) -> str:
    """An IPv6 address as a Host header writes it ("::1" -> "[::1]"); any other name as it is."""
    try:
        return f"[{ipaddress.IPv6Address(name)}]"
    except ValueError:
        return name


class HostCheck:
    """ASGI middleware: 421 for a Host the server does not go by; the request never reaches a route.

    A plain ASGI class rather than `@app.middleware("http")`: that wrapper hands the route a receive
    channel of its own, and the route would no longer see its client disconnect (aborts need that)."""

    def __init__(self, app, allowed: frozenset[str], metrics):
        self.app, self.allowed, self.metrics = app, allowed, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"host", b"").decode("latin-1")
        if host_name(given) in self.allowed:
            return await self.app(scope, receive, send)
        err = ErrorResponse(421, f"Host {given!r} is not a name of this server; start it with "
                                 "--allowed-hosts NAME to answer to that name", code="misdirected_request")
        self.metrics.rejected.labels("421").inc()
        await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)


def key_check(api_key: str | None) -> Callable:
    """The dependency of every route the key guards (none when the server has no key)."""

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            what = "missing" if not given else "wrong"
            raise ErrorResponse(401, f"{what} API key: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key")

    return require_key
