"""Listening sockets bound without the event loop's name resolution.

`loop.create_server(host=...)` resolves even an address literal with `getaddrinfo`, and uvloop
encodes the host with the `idna` codec first, which imports `stringprep` and `unicodedata` (~0.4
MB of a daemon's memory, BENCHMARKS.md "What a DHT-only daemon's memory is"). A socket bound here
to the literal is handed to the loop as `sock=` instead; it is set up as asyncio sets up its own
(SO_REUSEADDR, IPv6 sockets IPv6-only).
"""

from __future__ import annotations

import ipaddress
import socket

BACKLOG = 100  # asyncio's default


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A bound, listening, non-blocking TCP socket on the IP literal `host`; None when `host` is a
    name (the loop resolves it as before). Raises OSError when the address cannot be bound."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return None
    family = socket.AF_INET6 if version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
