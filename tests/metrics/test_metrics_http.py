"""The metrics HTTP responder on a real socket: scrapes, errors, limits."""

import asyncio

import pytest

from swarm.core.errors import ConfigError
from swarm.metrics.http import CONTENT_TYPE, MetricsServer


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_serves_metrics_and_answers_everything_else_clearly():
    renders = []

    def render() -> str:
        renders.append(1)
        return "x_total 1\n"

    async def go():
        server = MetricsServer(render, "127.0.0.1", 0)
        port = await server.start()
        assert port and server.url == f"http://127.0.0.1:{port}/metrics"
        try:
            status, headers, body = await request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (status, body) == (200, b"x_total 1\n")
            assert headers["Content-Type"] == CONTENT_TYPE and headers["Content-Length"] == "10"
            status, headers, body = await request(port, b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n")
            assert (status, body, headers["Content-Length"]) == (200, b"", "10")
            assert (await request(port, b"GET / HTTP/1.1\r\n\r\n"))[0] == 200
            assert (await request(port, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
            status, headers, _ = await request(port, b"POST /metrics HTTP/1.1\r\n\r\n")
            assert status == 405 and headers["Allow"] == "GET, HEAD"
            assert (await request(port, b"garbage\r\n\r\n"))[0] == 400
            assert (await request(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n"))[0] == 431
        finally:
            await server.ashutdown()
        assert len(renders) == 2

    run(go())


def test_a_failing_render_is_a_500_and_the_server_keeps_serving():
    calls = []

    def render() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return "ok 1\n"

    async def go():
        server = MetricsServer(render, "127.0.0.1", 0)
        port = await server.start()
        try:
            assert (await request(port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 500
            assert (await request(port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 200
        finally:
            await server.ashutdown()

    run(go())


def test_a_silent_client_is_dropped_after_the_read_timeout():
    async def go():
        server = MetricsServer(lambda: "", "127.0.0.1", 0, read_timeout=0.2)
        port = await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
            writer.close()
        finally:
            await server.ashutdown()

    run(go())


def test_a_taken_port_is_a_config_error():
    async def go():
        first = MetricsServer(lambda: "", "127.0.0.1", 0)
        port = await first.start()
        try:
            with pytest.raises(ConfigError, match="cannot serve metrics"):
                await MetricsServer(lambda: "", "127.0.0.1", port).start()
        finally:
            await first.ashutdown()

    run(go())
