"""`liveness.refuses_connections` on loopback: a closed port is gone, a port that holds the
connection is there, and a port that closes the connection it accepted and then itself (a process
on its way out, its connections closed before its listening socket) is found gone, not "still
accepting"."""

from __future__ import annotations

import asyncio
import socket

import pytest

from swarm.averaging.liveness import refuses_connections


def _addr(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}"


@pytest.mark.timeout(30)
def test_a_closed_port_is_gone_and_a_listening_one_is_there():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        assert asyncio.run(refuses_connections(_addr(closed.getsockname()[1]))) is True
    with socket.create_server(("127.0.0.1", 0)) as listening:  # its kernel accepts and holds the connection
        assert asyncio.run(refuses_connections(_addr(listening.getsockname()[1]), settle=0.2)) is False


@pytest.mark.timeout(30)
def test_a_port_that_closes_its_connection_and_then_itself_is_gone():
    """What a process on its way out does: the connection it accepted is closed without a byte,
    then its listening port; the probe asks again and is refused."""
    listening = socket.create_server(("127.0.0.1", 0))
    listening.setblocking(False)
    port = listening.getsockname()[1]

    async def main() -> bool:
        probe = asyncio.ensure_future(refuses_connections(_addr(port), settle=5.0))
        conn, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(listening), 10)
        conn.close()
        listening.close()  # before the probe runs again: its next connect is refused
        return await asyncio.wait_for(probe, 10)

    try:
        assert asyncio.run(main()) is True
    finally:
        listening.close()


def test_relayed_and_malformed_addresses_cannot_be_probed():
    assert asyncio.run(refuses_connections("/ip4/127.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit")) is False
    assert asyncio.run(refuses_connections("not an address")) is False
