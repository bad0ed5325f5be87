"""What one peer exposes at `--metrics-port`: its own gauges, its RPC metrics, and the registries.

A scrape renders, in order: the peer's built-in gauges (identity, uptime, known peers), the metrics of its gRPC server and client pool, `registry_for(peer)`, and the
process-wide `REGISTRY`. The peer is duck-typed (`peer_id`, `pool`, `server`, `dht`, `run`,
`attach`) so this module imports nothing above `swarm.metrics`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from swarm.metrics.http import MetricsServer
from swarm.metrics.registry import Registry, render

__all__ = ["PeerMetrics", "known_peers", "serve_metrics"]

logger = logging.getLogger(__name__)

def known_peers(peer: Any) -> tuple[str, int]:
    """How many peers this peer knows, and from where: the DHT's routing table, else open channels.

    EXTENSION POINT (swarm/dht): the first of `dht.routing_table`, `dht.node.routing_table`,
    `dht.protocol.routing_table` that exists is counted with `len()`; a DHT that keeps its table
    elsewhere should expose one of these (a `swarm.dht.routing.RoutingTable` has `__len__`).
    """
    dht = getattr(peer, "dht", None)
    if dht is not None:
        for path in (("routing_table",), ("node", "routing_table"), ("protocol", "routing_table"),
                     ("node", "protocol", "routing_table")):
            table: Any = dht
            for attr in path:
                table = getattr(table, attr, None)
                if table is None:
                    break
            if table is not None:
                try:
                    return "dht", len(table)
                except TypeError:
                    continue
    pool = getattr(peer, "pool", None)
    return "channels", (len(pool) if pool is not None else 0)


class PeerMetrics:
    """The built-in gauges of one peer, and the rendering of everything it exposes."""

    def __init__(self, peer: Any) -> None:
        from swarm import __version__
        from swarm.metrics import REGISTRY, registry_for

        self.peer = peer
        self._shared = (registry_for(peer), REGISTRY)
        self.registry = Registry()
        started = time.time()
        info = self.registry.gauge("swarm_peer_info", "This peer's identity (value is always 1)",
                                   ("peer_id", "version", "role", "client_mode"))
        info.labels(peer.peer_id, __version__, getattr(peer, "role", "peer"),
                    str(bool(getattr(peer, "client_mode", False))).lower()).set(1)
        self.registry.gauge("swarm_peer_start_time_seconds", "Unix time the metrics endpoint started").set(started)
        known = self.registry.gauge("swarm_known_peers",
                                    "Peers this peer knows: DHT routing table if it has one, else open channels",
                                    ("source",))
        source, _ = known_peers(peer)
        known.labels(source).set_function(lambda: known_peers(peer)[1])
        self.registry.gauge("swarm_open_channels", "gRPC channels open to other peers").set_function(
            lambda: len(peer.pool) if getattr(peer, "pool", None) is not None else 0)

    def render(self) -> str:
        parts = [self.registry]
        for owner in (getattr(self.peer, "server", None), getattr(self.peer, "pool", None)):
            metrics = getattr(owner, "metrics", None)
            if metrics is not None:
                parts.append(metrics.registry)
        parts.extend(self._shared)
        return render(parts)


def _bind_host(peer: Any) -> str:
    """Binds metrics where the peer listens: loopback stays loopback, anything else is all interfaces."""
    listen = getattr(peer, "listen", None)
    if listen is not None and getattr(listen, "protocol", "") == "ip4":
        return "127.0.0.1" if listen.host.startswith("127.") else "0.0.0.0"
    if listen is not None and getattr(listen, "protocol", "") == "ip6":
        return "::1" if listen.host == "::1" else "::"
    return "0.0.0.0"


def serve_metrics(peer: Any, port: int, host: str | None = None) -> MetricsServer:
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
