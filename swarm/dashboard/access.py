"""Who may see a private swarm's dashboard: the operator who holds the page's token
(docs/security.md, "The dashboard of a private swarm").

A private swarm keeps its picture (its peers, their addresses, runs' progress, the expert grid)
from strangers, and a dashboard would show it to anyone who reaches its port. So in a private
swarm the page is served only to a browser that presents the secret token the peer made at
start, as Jupyter does: the URL the operator gets (`page_url`, printed by `swarm-peer dashboard`
and by a daemon on stderr; never logged) carries it as `?token=…`; the first request with it sets a cookie
(HttpOnly, SameSite=Strict) that the page's own requests carry from then on; scripts may send
`Authorization: Bearer <token>` instead. Every other request gets 403 and nothing else. An
operator makes the page public with `--dashboard-public` (`public=True`); an open swarm's page
is public as before.

The cookie's name carries the dashboard's port (`cookie_name`): a browser sends a host's cookies
to every port of that host, so two dashboards on one host would otherwise overwrite each other's
cookie. That same rule means any other server on the host that the operator's browser visits
receives the token (docs/security.md).

`TokenGate` is an ASGI middleware wrapped around the dashboard's application: one place, in
front of every route. It lets only the server's `lifespan` events through unchecked; an HTTP
request or a websocket without the token is refused, and a connection of any other kind is
dropped.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs

__all__ = ["COOKIE_PREFIX", "DashboardAccess", "TokenGate", "cookie_name"]

COOKIE_PREFIX = "swarm_dashboard"

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSAL = (b"this dashboard belongs to a private swarm: open the URL its operator's peer printed at start "
            b"(it carries ?token=...), or start the peer with --dashboard-public to make the page public\n")


@dataclass(frozen=True)
class DashboardAccess:
    """Whether the page is public, and else the token a browser must present.

    Attributes:
        token: the secret; None: the page is public.
    """

    token: str | None = field(default=None, repr=False)

    @classmethod
    def for_swarm(cls, private: bool, public: bool) -> DashboardAccess:
        """A fresh random token for a private swarm's page, unless its operator made it public."""
        return cls(secrets.token_urlsafe(24) if private and not public else None)

    @property
    def public(self) -> bool:
        return self.token is None

    def url(self, base: str) -> str:
        """The page's URL as the operator opens it (the token in its query when there is one)."""
        return base if self.token is None else f"{base}?token={self.token}"

    def admits(self, presented: str) -> bool:
        """True when `presented` is the token (compared in constant time)."""
        return self.token is None or (bool(presented) and hmac.compare_digest(presented.encode(), self.token.encode()))

    def wrap(self, app: ASGIApp, port: int) -> ASGIApp:
        """`app` behind the token (itself when the page is public), served on `port` (its cookie's name)."""
        return app if self.token is None else TokenGate(app, self, port)


def cookie_name(port: int) -> str:
    """The name of the token's cookie for the dashboard on `port`: browsers send a host's cookies to
    every port of it, so each dashboard of a host needs a cookie of its own."""
    return f"{COOKIE_PREFIX}_{port}"


class TokenGate:
    """The ASGI middleware that refuses every request without the token (see the module docstring).

    Args:
        app: the dashboard's application.
        access: the token.
        port: the port the dashboard is served on (the cookie's name carries it).
    """

    def __init__(self, app: ASGIApp, access: DashboardAccess, port: int) -> None:
        self.app = app
        self.access = access
        self.cookie = cookie_name(port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":  # the server's own start and stop, no client behind it
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        query = scope.get("query_string", b"")
        from_query = parse_qs(query.decode("latin-1") if isinstance(query, bytes) else "").get("token", [""])[0]
        if kind == "http" and self.access.admits(from_query):
            await self.app(scope, receive, _setting_cookie(send, self.cookie, from_query))
            return
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        admitted = self.access.admits(from_query) or self.access.admits(
            _cookie(headers.get("cookie", ""), self.cookie)) or (
            scheme.lower() == "bearer" and self.access.admits(bearer.strip()))
        if admitted and kind in ("http", "websocket"):
            await self.app(scope, receive, send)
        elif kind == "http":
            await send({"type": "http.response.start", "status": 403, "headers": [
                (b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store"),
                (b"content-length", str(len(_REFUSAL)).encode())]})
            await send({"type": "http.response.body", "body": _REFUSAL})
        elif kind == "websocket" and (await receive()).get("type") == "websocket.connect":
            await send({"type": "websocket.close", "code": 1008})  # before the handshake: the client gets 403
        # any other kind of connection: nothing reaches the application


def _headers(scope: Scope) -> dict[str, str]:
    found: dict[str, str] = {}
    raw = scope.get("headers", [])
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], bytes) and isinstance(item[1], bytes):
            found.setdefault(item[0].decode("latin-1").lower(), item[1].decode("latin-1"))
    return found


def _cookie(header: str, name: str) -> str:
    """The value of the cookie `name` in a Cookie header (empty when absent). Each `;`-separated
    pair is read on its own, so another application's malformed cookie beside it (a space in a
    value, JSON) does not hide it, as it would from `http.cookies.SimpleCookie`."""
    for pair in header.split(";"):
        key, sep, value = pair.partition("=")
        if sep and key.strip() == name:
            value = value.strip()
            return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    return ""


def _setting_cookie(send: Send, name: str, token: str) -> Send:
    """`send`, with the token's cookie `name` added to the response's headers."""
    cookie = f"{name}={token}; Path=/; HttpOnly; SameSite=Strict".encode()

    async def wrapped(message: Message) -> None:
        if message.get("type") == "http.response.start":
            headers = message.get("headers", [])
            message["headers"] = [*(headers if isinstance(headers, list) else []), (b"set-cookie", cookie)]
        await send(message)

    return wrapped
