"""Listening and connected sockets made without the event loop's name resolution.

`loop.create_server(host=...)` and `loop.create_connection(host, ...)` resolve even an address
literal with `getaddrinfo`, and uvloop encodes the host with the `idna` codec first, which imports
`stringprep` and `unicodedata`, and runs the lookup on libuv's thread pool (its threads, and the
resolver's libraries: together ~1 MB of a daemon's memory, benchmarks/history/BENCHMARKS-2026-12-05.md "What a DHT-only
daemon's memory is"). A socket bound or connected here to the literal is handed to the loop as
`sock=` instead (a name is still resolved by the loop); a listening one is set up as asyncio sets up its own (SO_REUSEADDR, IPv6 sockets
IPv6-only).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket

BACKLOG = 100  # asyncio's default


def _family(host: str) -> socket.AddressFamily | None:
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return None
    return socket.AF_INET6 if version == 6 else socket.AF_INET


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A bound, listening, non-blocking TCP socket on the IP literal `host`; None when `host` is a
    name (the loop resolves it as before). Raises OSError when the address cannot be bound."""
    family = _family(host)
    if family is None:
        return None
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


async def connected_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to `host:port`: an IP literal directly, a name through
    the loop's resolver. Raises OSError (`ConnectionRefusedError`, `socket.gaierror`, ...) when the
    connection fails; the caller bounds the wait (`asyncio.wait_for`)."""
    loop = asyncio.get_running_loop()
    family = _family(host)
    if family is None:  # a name
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, infos[0][4])
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        failed = sock.connect_ex((host, port))
        if failed in (errno.EINPROGRESS, errno.EAGAIN):
            writable: asyncio.Future[None] = loop.create_future()

            def ready() -> None:
                if not writable.done():
                    writable.set_result(None)

            loop.add_writer(sock.fileno(), ready)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())
            failed = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if failed:
            raise OSError(failed, f"connect to {host}:{port} failed: {os.strerror(failed)}")
    except BaseException:
        sock.close()
        raise
    return sock
