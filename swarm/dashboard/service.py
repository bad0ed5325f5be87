"""Attaching a dashboard to a running peer: collector, HTTP server, stopped with the peer."""

from __future__ import annotations

import logging

from swarm.core.errors import ConfigError
from swarm.dashboard.access import DashboardAccess
from swarm.dashboard.collector import Collector, DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.view import Snapshot
from swarm.peer import Peer

__all__ = ["PeerDashboard", "serve_dashboard"]

logger = logging.getLogger(__name__)


class PeerDashboard:
    """The collector of one peer with its `History`, as the server's `SnapshotSource`."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    async def acollect(self) -> Snapshot:
        return await self.collector.acollect()

    def history_json(self) -> Snapshot:
        return self.collector.history.to_json()


def serve_dashboard(peer: Peer, config: DashboardConfig, public: bool = False) -> DashboardServer:
    """Serves the swarm's page from `peer` until it shuts down.

    Args:
        peer: a started `swarm.Peer` (a daemon, or a client-mode peer that only watches).
        config: where to serve and what to show.
        public: in a private swarm, serve the page to anyone who reaches it; by default only to a
            browser with the token in `page_url` (`swarm.dashboard.access`). An open swarm's is public.

    Returns:
        The running server (its `url` names the page); stopped with the peer.

    Raises:
        ConfigError: the `dashboard` extra is not installed, or the address cannot be bound.
    """
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("the dashboard needs the 'dashboard' extra: pip install 'swarm-peer[dashboard]'") from None
    access = DashboardAccess.for_swarm(private=peer.gate is not None, public=public)
    server = DashboardServer(PeerDashboard(Collector(peer, config)), config, access)
    peer.run(server.astart(), timeout=30)
    peer.attach(server)
    # never the token: logs are kept and shared; the operator gets `page_url` from what the command
    # line prints (`swarm.cli.dashboard`)
    logger.info("serving the swarm's dashboard at %s%s", server.url,
                "" if access.public else " (private: open the URL with the token printed at start)")
    return server
