"""`CallLimiter` without sockets: what one source network or caller may run at once and per second."""

from __future__ import annotations

import pytest

from swarm.core.errors import ConfigError, ResourceExhausted
from swarm.net.limits import CallLimit, CallLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_source_is_held_to_its_share_over_all_methods_whatever_its_identities() -> None:
    limiter = CallLimiter(per_source=3, per_caller=10)
    for i in range(3):
        limiter.admit(None, f"identity-{i}", "10.0.0.0/24")
    with pytest.raises(ResourceExhausted, match="per source address"):
        limiter.admit(None, "identity-new", "10.0.0.0/24")
    limiter.admit(None, "honest", "10.1.0.0/24")  # another network is served
    limiter.admit(None, "local", "")  # an exempt source is counted per caller only
    assert limiter.by_source == {"10.0.0.0/24": 3, "10.1.0.0/24": 1}
    limiter.release(None, "identity-0", "10.0.0.0/24")
    limiter.admit(None, "identity-new", "10.0.0.0/24")  # a released slot is free again
    for caller, source in [("identity-1", "10.0.0.0/24"), ("identity-2", "10.0.0.0/24"),
                           ("identity-new", "10.0.0.0/24"), ("honest", "10.1.0.0/24"), ("local", "")]:
        limiter.release(None, caller, source)
    assert limiter.by_source == {} and limiter.by_caller == {}
    assert limiter.refused == {"source": 1}


def test_one_caller_is_held_to_its_share_even_on_an_exempt_source() -> None:
    limiter = CallLimiter(per_source=100, per_caller=2)
    limiter.admit(None, "greedy", "")
    limiter.admit(None, "greedy", "")
    with pytest.raises(ResourceExhausted, match="per caller"):
        limiter.admit(None, "greedy", "")
    limiter.admit(None, "other", "")


def test_a_group_limit_holds_its_methods_only() -> None:
    limiter = CallLimiter(per_source=100, per_caller=100)
    streams = CallLimit("averaging calls", per_source=2, per_caller=1)
    limiter.admit(streams, "a", "10.0.0.0/24")
    with pytest.raises(ResourceExhausted, match="averaging calls in flight from you"):
        limiter.admit(streams, "a", "10.0.0.0/24")
    limiter.admit(streams, "b", "10.0.0.0/24")
    with pytest.raises(ResourceExhausted, match="averaging calls in flight from your network 10.0.0.0/24"):
        limiter.admit(streams, "c", "10.0.0.0/24")
    limiter.admit(None, "c", "10.0.0.0/24")  # other methods are not held back by the group's limit
    assert limiter.in_flight("averaging calls", source="10.0.0.0/24") == 2
    assert limiter.by_source == {"10.0.0.0/24": 3}  # refused calls took nothing


def test_a_source_past_its_rate_is_refused_until_its_bucket_refills() -> None:
    clock = Clock()
    limiter = CallLimiter(per_source=100, per_caller=100, clock=clock)
    stores = CallLimit("DHT stores", rate_per_source=10.0, burst_per_source=5)
    for _ in range(5):
        limiter.admit(stores, "x", "10.0.0.0/24")
        limiter.release(stores, "x", "10.0.0.0/24")
    with pytest.raises(ResourceExhausted, match="more than 10 DHT stores per second"):
        limiter.admit(stores, "y", "10.0.0.0/24")  # a new identity does not help
    limiter.admit(stores, "z", "10.9.0.0/24")  # another network has its own bucket
    limiter.admit(stores, "local", "")  # exempt sources are not rate limited
    clock.now += 0.1  # one token back
    limiter.admit(stores, "y", "10.0.0.0/24")
    with pytest.raises(ResourceExhausted):
        limiter.admit(stores, "y", "10.0.0.0/24")


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        CallLimit("x", per_source=0)
    with pytest.raises(ConfigError):
        CallLimit("x", rate_per_source=0)
    with pytest.raises(ConfigError):
        CallLimiter(per_source=0, per_caller=1)
    assert CallLimit("x", rate_per_source=3.0).burst_per_source == 6


def test_bulk_streams_count_against_their_source_network(make_peer) -> None:
    """Streams over the bulk side channel are limited by the socket's source network too."""
    import asyncio
    import threading

    from swarm.net.server import ServerConfig

    server = make_peer(server_config=ServerConfig(source_exempt=()))  # loopback counts as 127.0.0.0/24 here
    client = make_peer(client_mode=True)
    entered: list[tuple[str, bool]] = []
    two_in = threading.Event()

    async def stall(requests, ctx):
        entered.append((ctx.source, ctx.connection is not None))
        if len(entered) == 2:
            two_in.set()
        async for _ in requests:
            pass
        yield b"done"

    server.server.add_stream("/test.Stall/Open", stall, bulk=True, limit=CallLimit("stalls", per_source=2))
    release = asyncio.Event()

    async def held():
        yield b"x"
        await release.wait()

    async def one():
        channel = client.pool.get(server.addrs[0])
        try:
            return [bytes(m) async for m in channel.stream("/test.Stall/Open", held(), timeout=30, bulk=True)]
        except ResourceExhausted as e:
            return e

    async def start():
        return [asyncio.ensure_future(one()) for _ in range(2)]

    first = client.run(start())
    assert two_in.wait(20), entered
    third = client.run(one(), timeout=30)
    assert isinstance(third, ResourceExhausted) and "per source address" in str(third)
    client.loop.loop.call_soon_threadsafe(release.set)

    async def finish():
        return await asyncio.gather(*first)

    assert client.run(finish(), timeout=30) == [[b"done"], [b"done"]]
    assert entered == [("127.0.0.0/24", True), ("127.0.0.0/24", True)]  # both came over the bulk channel
