"""A caller's and a callee's `FrameConnection` over a real loopback TCP connection, after a real
TLS handshake and key agreement, with sealed records between them (swarm.net.sealed)."""

from __future__ import annotations

import asyncio
from typing import Any

from swarm.core.identity import Identity
from swarm.net import frames, sealed, tls


async def sealed_pair(sink: Any = None, off_loop: bool | None = None, capacity: int = 8 << 20) -> tuple[Any, ...]:
    """(caller FrameConnection, caller SealedProtocol, callee FrameConnection, callee
    SealedProtocol, server); the callee's connection has `sink` when one is given."""
    identity = Identity.generate()
    context = tls.server_context(tls.PeerCertificate.issue(identity))
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future = loop.create_future()

    def callee() -> sealed.SealedProtocol:
        conn = frames.FrameConnection(capacity)
        if sink is not None:
            conn.set_sink(sink)
        protocol = sealed.SealedProtocol(conn, context, server_side=True, certificate=context.certificate_der,
                                         off_loop=off_loop)
        accepted.set_result((conn, protocol))
        return protocol

    server = await loop.create_server(callee, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = frames.FrameConnection(capacity)
    _, protocol = await loop.create_connection(
        lambda: sealed.SealedProtocol(conn, tls.client_context(identity.peer_id), server_side=False,
                                      server_hostname=tls.SERVER_NAME, off_loop=off_loop), "127.0.0.1", port)
    await asyncio.wait_for(protocol.ready, 10)
    callee_conn, callee_protocol = await asyncio.wait_for(accepted, 10)
    await asyncio.wait_for(callee_protocol.ready, 10)
    return conn, protocol, callee_conn, callee_protocol, server
