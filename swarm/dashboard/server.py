"""DashboardServer: serves the page and its live updates over HTTP, on the peer's own event loop.

Built on Starlette (routes, responses, static files) served by uvicorn, both in the optional
`dashboard` extra and imported only when a dashboard is asked for (BENCHMARKS.md, "Dashboard":
why these two). Read-only: every route is a GET; nothing a page sends changes the peer.

    GET /                 the page (static HTML, JS and the vendored uPlot; works offline)
    GET /static/...       its files
    GET /api/snapshot     the latest snapshot (JSON, `swarm.dashboard.view.build_view`)
    GET /api/history      the curves of the last hours (JSON, `History.to_json`)
    GET /api/events       server-sent events: `history` once, then `snapshot` after every
                          collection and `experts` whenever the grid changed

A refresh task collects a snapshot every `refresh_period` (`SnapshotSource.acollect`) and
encodes it once for every connected page. Pages connected at once are capped
(`DashboardConfig.max_clients`): one more gets 503. Responses carry a Content-Security-Policy
that allows only the page's own scripts, a second wall behind the page inserting every
peer-reported string as text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from swarm.core.errors import ConfigError
from swarm.core.loop import spawn
from swarm.dashboard.access import DashboardAccess
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.view import Snapshot

if TYPE_CHECKING:
    import uvicorn

__all__ = ["DashboardServer", "SnapshotSource"]

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HEARTBEAT_S = 15.0
STARTUP_TIMEOUT_S = 10.0


class SnapshotSource(Protocol):
    """Where snapshots come from: the `Collector`, or a synthetic swarm (benchmarks, tests)."""

    async def acollect(self) -> Snapshot: ...

    def history_json(self) -> Snapshot: ...


def _encode(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class DashboardServer:
    """The dashboard's HTTP server and refresh task (see the module docstring).

    Args:
        source: what builds each snapshot.
        config: address, port, refresh period, client cap.
        access: who may see the page (a private swarm's token; `swarm.dashboard.access`); public by default.
    """

    def __init__(self, source: SnapshotSource, config: DashboardConfig, access: DashboardAccess | None = None) -> None:
        self.source = source
        self.config = config
        self.access = access or DashboardAccess()
        self.port = config.port
        self._snapshot = "{}"
        self._experts = "{}"
        self._grid: object = None
        self._version = 0
        self._experts_version = 0
        self._changed = asyncio.Condition()
        self._clients = 0
        self._closing = asyncio.Event()
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self.collections = 0
        self.last_collect_s = 0.0

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/"

    @property
    def page_url(self) -> str:
        """The URL the operator opens: `url`, with the token of a private swarm's page."""
        return self.access.url(self.url)

    # -- lifecycle ----------------------------------------------------------------------------

    async def astart(self) -> int:
        """Collects once, binds, starts serving; returns the port."""
        import uvicorn  # the `dashboard` extra

        await self._collect()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.host, self.config.port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot serve the dashboard on {self.config.host}:{self.config.port}: "
                              f"{e.strerror}") from None
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(
            self._app(), log_config=None, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=1, server_header=False,
        ))
        self._server = server
        self._serve_task = spawn(server.serve(sockets=[sock]), name="dashboard-http")
        self._refresh_task = spawn(self._refresh(), name="dashboard-refresh")
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not server.started:  # uvicorn offers no event for it
            if self._serve_task.done() or asyncio.get_running_loop().time() > deadline:
                await self.ashutdown()
                raise ConfigError(f"the dashboard's HTTP server did not start on {self.url}")
            await asyncio.sleep(0.01)
        return self.port

    async def ashutdown(self) -> None:
        """Stops the refresh task, ends every live stream, stops the HTTP server."""
        self._closing.set()
        async with self._changed:
            self._changed.notify_all()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        if self._server is not None:
            self._server.should_exit = True
        if self._serve_task is not None:
            await asyncio.gather(self._serve_task, return_exceptions=True)

    async def _refresh(self) -> None:
        while not self._closing.is_set():
            try:
                await asyncio.wait_for(self._closing.wait(), self.config.refresh_period)
            except TimeoutError:
                await self._collect()

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            view = await self.source.acollect()
        except Exception:  # one failed collection keeps the last snapshot on the page
            logger.exception("the dashboard's collection failed; the page keeps the last snapshot")
            return
        self.last_collect_s = loop.time() - started
        self.collections += 1
        grid = view.pop("experts", {})
        experts = self._experts if grid is self._grid else _encode(grid)  # a kept grid is not encoded again
        self._grid = grid
        async with self._changed:
            self._snapshot = _encode(view)
            if experts != self._experts:
                self._experts = experts
                self._experts_version += 1
            self._version += 1
            self._changed.notify_all()

    # -- HTTP ---------------------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import FileResponse, Response, StreamingResponse
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles

        async def index(request: Request) -> Response:
            return FileResponse(STATIC / "index.html", headers=HEADERS)

        async def snapshot(request: Request) -> Response:
            body = self._snapshot[:-1] + ',"experts":' + self._experts + "}" if self._snapshot != "{}" else "{}"
            return Response(body, media_type="application/json", headers=HEADERS)

        async def history(request: Request) -> Response:
            return Response(_encode(self.source.history_json()), media_type="application/json", headers=HEADERS)

        async def events(request: Request) -> Response:
            if self._clients >= self.config.max_clients:
                return Response("too many dashboard pages open on this peer\n", status_code=503, headers=HEADERS)
            return StreamingResponse(self._stream(), media_type="text/event-stream",
                                     headers={**HEADERS, "X-Accel-Buffering": "no"})

        class Static(StaticFiles):
            async def get_response(self, path: str, scope: Any) -> Response:
                response = await super().get_response(path, scope)
                response.headers.update(HEADERS)
                return response

        return self.access.wrap(Starlette(routes=[
            Route("/", index, methods=["GET", "HEAD"]),
            Route("/api/snapshot", snapshot, methods=["GET"]),
            Route("/api/history", history, methods=["GET"]),
            Route("/api/events", events, methods=["GET"]),
            Mount("/static", Static(directory=STATIC), name="static"),
        ]), self.port)

    async def _wait_past(self, version: int) -> bool:
        """Waits for a snapshot newer than `version` (or the end); False after a quiet heartbeat."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self._version != version or self._closing.is_set()), HEARTBEAT_S)
            except TimeoutError:
                return False
        return True

    async def _stream(self) -> AsyncIterator[str]:
        self._clients += 1
        try:
            yield f"event: history\ndata: {_encode(self.source.history_json())}\n\n"
            seen_experts = 0
            seen = 0
            while not self._closing.is_set():
                if seen_experts != self._experts_version:
                    seen_experts = self._experts_version
                    yield f"event: experts\ndata: {self._experts}\n\n"
                if seen != self._version:
                    seen = self._version
                    yield f"event: snapshot\ndata: {self._snapshot}\n\n"
                if not await self._wait_past(seen):
                    yield ": keep-alive\n\n"
        finally:
            self._clients -= 1
