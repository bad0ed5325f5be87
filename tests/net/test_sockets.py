"""Listening and connected sockets made for address literals without the loop's resolver (swarm/net/sockets.py)."""

import asyncio
import os
import socket

import pytest

from swarm.net.sockets import connected_socket, listening_socket


def test_a_name_is_left_to_the_loop():
    assert listening_socket("localhost", 0) is None


@pytest.mark.parametrize("host, family", [("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET)])
def test_an_ipv4_literal_is_bound_listening_and_non_blocking(host, family):
    sock = listening_socket(host, 0)
    assert sock is not None
    with sock:
        assert sock.family == family and not sock.getblocking()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        assert sock.getsockname()[0] == host and sock.getsockname()[1] > 0


def test_an_ipv6_literal_is_ipv6_only():
    try:
        sock = listening_socket("::1", 0)
    except OSError as e:  # a host without IPv6 on loopback
        pytest.skip(f"no IPv6 loopback: {e}")
    assert sock is not None
    with sock:
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1


def test_a_port_in_use_raises_and_leaves_no_socket_open():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        open_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        with pytest.raises(OSError, match="in use"):
            listening_socket("127.0.0.1", taken.getsockname()[1])
        if open_before is not None:
            assert len(os.listdir("/proc/self/fd")) == open_before


def test_the_loop_serves_on_it():
    async def main() -> bytes:
        sock = listening_socket("127.0.0.1", 0)
        assert sock is not None

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(5))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            writer.write(b"hello")
            data = await reader.readexactly(5)
            writer.close()
            await writer.wait_closed()
            return data

    assert asyncio.run(asyncio.wait_for(main(), 10)) == b"hello"


# -- connected sockets -----------------------------------------------------------------------

def test_a_name_is_resolved_by_the_loop_and_connected():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        async def main() -> tuple[str, int]:
            sock = await connected_socket("localhost", port)
            with sock:
                assert not sock.getblocking()
                return sock.getpeername()[:2]

        try:
            peer = asyncio.run(main())
        except OSError as e:  # "localhost" names only ::1 here
            pytest.skip(f"localhost does not reach 127.0.0.1: {e}")
        assert peer == ("127.0.0.1", port)


def test_a_literal_is_connected_non_blocking_and_carries_bytes():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        async def main() -> bytes:
            sock = await connected_socket("127.0.0.1", port)
            assert sock is not None and not sock.getblocking()
            reader, writer = await asyncio.open_connection(sock=sock)
            accepted, _ = server.accept()
            with accepted:
                accepted.sendall(b"hi")
                data = await reader.readexactly(2)
            writer.close()
            return data

        assert asyncio.run(main()) == b"hi"


def test_a_refused_connection_raises_its_error_and_leaves_no_socket_open():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        port = closed.getsockname()[1]
        open_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        with pytest.raises(ConnectionRefusedError, match="connect to 127.0.0.1"):
            asyncio.run(connected_socket("127.0.0.1", port))
        if open_before is not None:
            assert len(os.listdir("/proc/self/fd")) == open_before
