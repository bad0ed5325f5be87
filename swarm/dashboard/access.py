"""Who may see a private swarm's dashboard: the operator who holds the page's token
(docs/security.md, "The dashboard of a private swarm").

A private swarm keeps its picture (its peers, their addresses, runs' progress, the expert grid)
from strangers, and a dashboard would show it to anyone who reaches its port. So in a private
swarm the page is served only to a browser that presents the secret token the peer made at
start, as Jupyter does: the URL the operator gets (`page_url`, printed by `swarm-peer dashboard`
and logged by a daemon) carries it as `?token=…`; the first request with it sets a cookie
(HttpOnly, SameSite=Strict) that the page's own requests carry from then on; scripts may send
`Authorization: Bearer <token>` instead. Every other request gets 403 and nothing else. An
operator makes the page public with `--dashboard-public` (`public=True`); an open swarm's page
is public as before.

`TokenGate` is an ASGI middleware wrapped around the dashboard's application: one place, in
front of every route.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

__all__ = ["COOKIE", "DashboardAccess", "TokenGate"]

COOKIE = "swarm_dashboard"

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

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the token (itself when the page is public)."""
        return app if self.token is None else TokenGate(app, self)


class TokenGate:
    """The ASGI middleware that refuses every request without the token (see the module docstring)."""

    def __init__(self, app: ASGIApp, access: DashboardAccess) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        query = scope.get("query_string", b"")
        from_query = parse_qs(query.decode("latin-1") if isinstance(query, bytes) else "").get("token", [""])[0]
        if from_query and self.access.admits(from_query):
            await self.app(scope, receive, _setting_cookie(send, from_query))
            return
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        if self.access.admits(_cookie(headers.get("cookie", ""))) or (
                scheme.lower() == "bearer" and self.access.admits(bearer.strip())):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store"),
            (b"content-length", str(len(_REFUSAL)).encode())]})
        await send({"type": "http.response.body", "body": _REFUSAL})


def _headers(scope: Scope) -> dict[str, str]:
    found: dict[str, str] = {}
    raw = scope.get("headers", [])
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], bytes) and isinstance(item[1], bytes):
            found.setdefault(item[0].decode("latin-1").lower(), item[1].decode("latin-1"))
    return found


def _cookie(header: str) -> str:
    try:
        morsel = SimpleCookie(header).get(COOKIE)
    except CookieError:
        return ""
    return morsel.value if morsel is not None else ""


def _setting_cookie(send: Send, token: str) -> Send:
    """`send`, with the token's cookie added to the response's headers."""
    cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()

    async def wrapped(message: Message) -> None:
        if message.get("type") == "http.response.start":
            headers = message.get("headers", [])
            message["headers"] = [*(headers if isinstance(headers, list) else []), (b"set-cookie", cookie)]
        await send(message)

    return wrapped
