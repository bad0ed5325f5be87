"""`TokenGate`, the private dashboard's token check, driven as an ASGI server drives it (no socket):
what a request, a websocket or a connection of another kind gets with and without the token, and
the cookie read out of a Cookie header that also holds other applications' cookies. The real HTTP
server behind it: tests/security/test_private_dashboard.py."""

from __future__ import annotations

import asyncio

from swarm.dashboard.access import DashboardAccess, Message, Scope, cookie_name

TOKEN = "s3cret-Token_value"
PORT = 8470


async def _page(scope: Scope, receive, send) -> None:
    """The application behind the gate: answers 200 "page" to HTTP, accepts a websocket."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"page"})
    elif scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
    else:
        await send({"type": "reached", "scope": scope["type"]})


def _call(scope: Scope, inbound: list[Message] | None = None) -> list[Message]:
    """What the gate in front of `_page` sends back for `scope`."""
    sent: list[Message] = []
    pending = list(inbound or [{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> Message:
        return pending.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    gate = DashboardAccess(TOKEN).wrap(_page, PORT)
    asyncio.run(asyncio.wait_for(gate(scope, receive, send), 10))
    return sent


def _http(cookie: str | None = None, query: bytes = b"") -> Scope:
    headers = [(b"host", b"127.0.0.1")] + ([(b"cookie", cookie.encode())] if cookie is not None else [])
    return {"type": "http", "method": "GET", "path": "/", "query_string": query, "headers": headers}


def _status(sent: list[Message]) -> int:
    return next(int(m["status"]) for m in sent if m["type"] == "http.response.start")


def test_the_cookie_is_found_beside_other_applications_malformed_cookies() -> None:
    ours = f"{cookie_name(PORT)}={TOKEN}"
    for header in (f"x=a b; {ours}",  # a space in another cookie's value
                   f'prefs={{"theme":"dark","n":[1,2]}}; {ours}; other=1',  # a JSON-valued cookie
                   f"{ours};broken;=;  y=\"unterminated",  # pairs without a name or a value
                   f'{cookie_name(PORT)}="{TOKEN}"'):  # the value quoted
        assert _status(_call(_http(header))) == 200, header
    for header in (f"x{ours}",  # the name must match exactly, not as a suffix
                   f"{cookie_name(PORT)}x={TOKEN}", f"{cookie_name(PORT)}={TOKEN}x", f"{cookie_name(PORT)}=",
                   f"{cookie_name(PORT + 1)}={TOKEN}", ""):  # another port's dashboard's cookie
        sent = _call(_http(header))
        assert _status(sent) == 403 and b"private swarm" in sent[-1]["body"], header


def test_the_token_in_the_query_sets_a_cookie_named_after_the_port() -> None:
    sent = _call(_http(query=f"token={TOKEN}".encode()))
    start = sent[0]
    assert start["status"] == 200 and sent[-1]["body"] == b"page"
    cookies = [value.decode() for name, value in start["headers"] if name == b"set-cookie"]
    assert cookies == [f"swarm_dashboard_{PORT}={TOKEN}; Path=/; HttpOnly; SameSite=Strict"]
    assert _status(_call(_http(query=b"token=wrong"))) == 403


def test_a_websocket_without_the_token_is_closed_before_it_reaches_the_application() -> None:
    connect = [{"type": "websocket.connect"}]
    scope = {"type": "websocket", "path": "/api/events", "query_string": b"", "headers": []}
    assert _call(scope, connect) == [{"type": "websocket.close", "code": 1008}]
    with_cookie = {**scope, "headers": [(b"cookie", f"{cookie_name(PORT)}={TOKEN}".encode())]}
    assert _call(with_cookie, connect) == [{"type": "websocket.accept"}]
    assert _call({**scope, "query_string": f"token={TOKEN}".encode()}, connect) == [{"type": "websocket.accept"}]


def test_only_the_servers_lifespan_passes_without_the_token() -> None:
    assert _call({"type": "lifespan"}, [{"type": "lifespan.startup"}]) == [{"type": "reached", "scope": "lifespan"}]
    assert _call({"type": "webtransport", "headers": []}) == []  # an unknown kind: nothing reaches the page
