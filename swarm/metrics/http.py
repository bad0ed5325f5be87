"""A tiny HTTP/1.1 responder for Prometheus scrapes, running on the peer's own event loop.

It answers `GET /metrics` (and `HEAD`) with the text exposition, `GET /` with a pointer to it, and
anything else with a short error; one request per connection. It exists so that metrics need no
extra thread (prometheus_client's own HTTP server runs one per port) and the RPC numbers are read
on the loop that writes them: a scrape costs one render on the loop, a few milliseconds at most.
Request heads are capped in size and time, and connections in number, so a stray client cannot
hold the peer's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from swarm.core.errors import ConfigError

__all__ = ["CONTENT_TYPE", "MetricsServer"]

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what `generate_latest` writes
_MAX_HEAD_BYTES = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class MetricsServer:
    """Serves `render()` at ``http://host:port/metrics``; `await start()` binds (port 0 picks one).

    Args:
        render: returns the exposition text; called on the event loop for every scrape.
        host: address to bind ("0.0.0.0" for every IPv4 interface, "::" for IPv6).
        port: TCP port; 0 picks a free one (read `port` after `start`).
        max_connections: connections served at once; more get 503.
        read_timeout: seconds a client gets to send its request head.
    """

    def __init__(self, render: Callable[[], str], host: str = "0.0.0.0", port: int = 0, *,
                 max_connections: int = 16, read_timeout: float = 5.0) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be a TCP port, got {port}")
        self.render = render
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self._server: asyncio.Server | None = None
        self._active = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=_MAX_HEAD_BYTES)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {e.strerror}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def ashutdown(self) -> None:
        """Stops accepting scrapes (a `swarm.peer.Component`, stopped with the peer)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._active += 1
        try:
            if self._active > self.max_connections:
                await self._respond(writer, 503, "too many concurrent scrapes\n")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
            except asyncio.LimitOverrunError:
                await self._respond(writer, 431, "request head too large\n")
                return
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            await self._answer(writer, head)
        except ConnectionError:
            pass
        except Exception:  # a scrape must never take the peer down
            logger.exception("metrics request failed")
        finally:
            self._active -= 1
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def _answer(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._respond(writer, 400, "malformed request line\n")
            return
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            await self._respond(writer, 405, "only GET and HEAD\n", extra="Allow: GET, HEAD\r\n")
            return
        path = target.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = self.render()
            except Exception:  # one broken metric must not hide the others' failure from the log
                logger.exception("rendering metrics failed")
                await self._respond(writer, 500, "rendering metrics failed; see the peer's log\n")
                return
            await self._respond(writer, 200, body, content_type=CONTENT_TYPE, head_only=method == "HEAD")
        elif path == "/":
            await self._respond(writer, 200, "swarm peer: metrics at /metrics\n", head_only=method == "HEAD")
        else:
            await self._respond(writer, 404, f"no {path} here; metrics are at /metrics\n")

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int, body: str, *,
                       content_type: str = "text/plain; charset=utf-8", extra: str = "",
                       head_only: bool = False) -> None:
        data = body.encode()
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n")
        writer.write(head.encode("latin-1") + (b"" if head_only else data))
        await writer.drain()
