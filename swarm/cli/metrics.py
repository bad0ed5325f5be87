"""What one peer exposes at `--metrics-port`: its own gauges, its RPC metrics, and the registries.

A scrape renders, in order: the peer's built-in gauges (identity, uptime, known peers), the metrics
of its gRPC server and client pool, the peer's own registry (`Peer.metrics_registry`), and the
process-wide `swarm.metrics.REGISTRY`. What each family means: docs/operations.md, "Metrics".
"""

from __future__ import annotations

import logging
import time

from swarm.core.version import __version__
from swarm.metrics import REGISTRY
from swarm.metrics.http import MetricsServer
from swarm.metrics.registry import Registry, render
from swarm.peer import Peer

__all__ = ["PeerMetrics", "known_peers", "serve_metrics"]

logger = logging.getLogger(__name__)


def known_peers(peer: Peer) -> tuple[str, int]:
    """How many peers this peer knows, and from where: the DHT's routing table, else open channels."""
    if peer.dht is not None:
        return "dht", len(peer.dht.known_peers())
    return "channels", len(peer.pool)


class PeerMetrics:
    """The built-in gauges of one peer, and the rendering of everything it exposes."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.registry = Registry()
        info = self.registry.gauge("swarm_peer_info", "This peer's identity (value is always 1)",
                                   ("peer_id", "version", "role", "client_mode"))
        info.labels(peer.peer_id, __version__, peer.role, str(peer.client_mode).lower()).set(1)
        self.registry.gauge("swarm_peer_start_time_seconds", "Unix time the metrics endpoint started").set(time.time())
        known = self.registry.gauge("swarm_known_peers",
                                    "Peers this peer knows: DHT routing table if it has one, else open channels",
                                    ("source",))
        source, _ = known_peers(peer)
        known.labels(source).set_function(lambda: known_peers(peer)[1])
        self.registry.gauge("swarm_open_channels", "gRPC channels open to other peers").set_function(
            lambda: len(peer.pool))

    def render(self) -> str:
        parts = [self.registry]
        if self.peer.server is not None:
            parts.append(self.peer.server.metrics.registry)
        parts += [self.peer.pool.metrics.registry, self.peer.metrics_registry, REGISTRY]
        return render(parts)


def _bind_host(peer: Peer) -> str:
    """Binds metrics where the peer listens: loopback stays loopback, anything else is all interfaces."""
    if peer.listen.protocol == "ip4":
        return "127.0.0.1" if peer.listen.host.startswith("127.") else "0.0.0.0"
    if peer.listen.protocol == "ip6":
        return "::1" if peer.listen.host == "::1" else "::"
    return "0.0.0.0"


def serve_metrics(peer: Peer, port: int, host: str | None = None) -> MetricsServer:
    """Serves the peer's metrics over HTTP on its event loop until the peer shuts down.

    Args:
        peer: a started `swarm.Peer`.
        port: TCP port; 0 picks a free one (logged, and in the returned server's `port`).
        host: address to bind; by default loopback if the peer listens on loopback, else all.

    Returns:
        The running `MetricsServer` (stopped with the peer: it is attached as a component).
    """
    exporter = PeerMetrics(peer)
    server = MetricsServer(exporter.render, host or _bind_host(peer), port)
    peer.run(server.start(), timeout=10)
    peer.attach(server)
    logger.info("serving Prometheus metrics at %s", server.url)
    return server
