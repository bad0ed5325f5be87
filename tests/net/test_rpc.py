"""The gRPC layer with real servers on port 0: authentication, deadlines, limits, bad input."""

import asyncio
import socket
import threading
import time

import pytest

from swarm.core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PeerUnreachable,
    RemoteError,
    ResourceExhausted,
    Unauthenticated,
)
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.net.channels import INFO, ChannelConfig
from swarm.net.server import ServerConfig
from swarm.proto import peer_pb2


def test_info_names_the_callee_and_the_caller_is_authenticated(make_peer):
    a, b = make_peer(), make_peer()
    seen = []

    async def whoami(request: bytes, ctx):
        seen.append(ctx.peer_id)
        return b"ok"

    a.server.add_unary("/test.T/WhoAmI", whoami)

    async def go():
        ch = b.pool.get(a.addrs[0])
        info = await ch.info()
        return info, await ch.unary("/test.T/WhoAmI", b"")

    info, answer = b.run(go())
    assert info.peer_id == a.peer_id and list(info.addrs) == a.addrs and info.version
    assert answer == b"ok" and seen == [b.peer_id]


def test_client_mode_peer_has_no_server_but_can_call(make_peer):
    a = make_peer()
    c = make_peer(client_mode=True)
    assert c.server is None and c.addrs == []
    info = c.run(c.pool.get(a.addrs[0]).info())
    assert info.peer_id == a.peer_id


def test_impostor_server_is_refused(make_peer):
    real, impostor, caller = make_peer(), make_peer(), make_peer()
    # the caller dials the impostor's address believing it is `real`
    fake = Multiaddr.parse(impostor.addrs[0]).with_peer_id(real.peer_id)
    with pytest.raises(Unauthenticated, match=f"is not {real.peer_id}"):
        caller.run(caller.pool.get(fake).info())


def test_impostor_caller_is_refused(make_peer):
    a, mallory = make_peer(), make_peer()
    alice = Identity.generate()
    ticket = mallory.pool.signer.metadata_for(a.peer_id)[0][1]
    forged = ticket[:4] + alice.public_key + ticket[36:]  # claim Alice's key, signed by Mallory

    async def go():
        ch = mallory.pool.get(a.addrs[0])
        await ch.verify()
        return await ch.channel.unary_unary(INFO)(
            peer_pb2.InfoRequest().SerializeToString(), timeout=5, metadata=(("swarm-ticket-bin", forged),)
        )

    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as info:
        mallory.run(go())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def anonymous():
        ch = mallory.pool.get(a.addrs[0])
        return await ch._raw_unary(INFO, peer_pb2.InfoRequest(), None, 5, metadata=())

    with pytest.raises(Unauthenticated, match="no swarm ticket"):
        mallory.run(anonymous())


def test_dial_unknown_learns_the_peer_id(make_peer):
    a, b = make_peer(), make_peer()
    bare = str(Multiaddr.parse(a.addrs[0]).with_peer_id(None))
    channel = b.run(b.pool.dial_unknown(bare))
    assert channel.peer_id == a.peer_id


@pytest.fixture
def black_hole():
    """A TCP listener that accepts connections and never answers (an unresponsive host)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield listener.getsockname()[1]
    stop.set()
    t.join()
    for s in accepted:
        s.close()
    listener.close()


def test_call_to_black_holed_address_fails_within_its_deadline(make_peer, black_hole):
    b = make_peer()
    target = f"/ip4/127.0.0.1/tcp/{black_hole}/p2p/{Identity.generate().peer_id}"

    async def go():
        ch = b.pool.get(target)
        return await ch._raw_unary(INFO, peer_pb2.InfoRequest(), None, 0.5, metadata=())

    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        b.run(go())
    assert time.monotonic() - start < 10.0  # the 0.5 s deadline, not a handshake the host never answers


def test_refused_connection_is_peer_unreachable(make_peer):
    b = make_peer()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(PeerUnreachable):
        b.run(b.pool.get(f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}").info(timeout=2))


@pytest.mark.parametrize("multiplex", [True, False], ids=["calls-stream", "unary-calls"])
def test_bad_input_gets_clear_statuses_and_the_server_keeps_serving(make_peer, multiplex):
    # the same statuses whether small calls share a Calls stream (swarm.net.calls) or not
    a = make_peer(server_config=ServerConfig(max_message_bytes=2 << 20))
    b = make_peer(channel_config=ChannelConfig(multiplex=multiplex))

    async def echo(request: peer_pb2.HandshakeRequest, ctx):
        if request.challenge == b"value-error":
            raise ValueError("challenge must not be 'value-error'")
        if request.challenge == b"crash":
            raise ZeroDivisionError("division by zero")
        if request.challenge == b"huge":
            return b"h" * (3 << 20)
        return request

    a.server.add_unary("/test.T/Echo", echo, peer_pb2.HandshakeRequest)
    ch = b.pool.get(a.addrs[0])

    def call(method, payload):
        return b.run(ch.unary(method, payload, timeout=5))

    with pytest.raises(InvalidRequest, match="malformed HandshakeRequest"):
        call("/test.T/Echo", b"\xff\xff\xff\xff")
    with pytest.raises(ResourceExhausted):
        call("/test.T/Echo", b"\x00" * (3 << 20))
    with pytest.raises(NotFound):
        call("/test.T/NoSuchMethod", b"")
    with pytest.raises(InvalidRequest, match="must not be 'value-error'"):
        call("/test.T/Echo", peer_pb2.HandshakeRequest(challenge=b"value-error"))
    with pytest.raises(RemoteError, match="internal error in /test.T/Echo: ZeroDivisionError"):
        call("/test.T/Echo", peer_pb2.HandshakeRequest(challenge=b"crash"))
    with pytest.raises(ResourceExhausted):
        call("/test.T/Echo", peer_pb2.HandshakeRequest(challenge=b"huge"))
    ok = peer_pb2.HandshakeRequest.FromString(call("/test.T/Echo", peer_pb2.HandshakeRequest(challenge=b"fine")))
    assert ok.challenge == b"fine" and ch.calls_supported == multiplex


def test_concurrency_cap_refuses_with_resource_exhausted(make_peer):
    a = make_peer(server_config=ServerConfig(max_concurrent_rpcs=4))
    b = make_peer()
    release = asyncio.Event()

    async def slow(request: bytes, ctx):
        await release.wait()
        return b"done"

    a.server.add_unary("/test.T/Slow", slow)

    async def go():
        ch = b.pool.get(a.addrs[0])
        await ch.verify()
        calls = [asyncio.ensure_future(ch.unary("/test.T/Slow", b"", timeout=10)) for _ in range(12)]
        pending = set(calls)
        while len(pending) > 4:  # the calls past the cap are refused without waiting for the slow ones
            done, pending = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
        a.loop.loop.call_soon_threadsafe(release.set)
        return await asyncio.gather(*calls, return_exceptions=True)

    results = b.run(go())
    assert sum(r == b"done" for r in results) >= 1
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(refused) == 12 - 4 and sum(r == b"done" for r in results) == 4


def test_taken_port_fails_loudly(make_peer):
    a = make_peer()
    from swarm.core.errors import ConfigError

    port = a.addrs[0].split("/")[4]
    with pytest.raises(ConfigError, match="port taken"):
        make_peer(listen=f"/ip4/127.0.0.1/tcp/{port}")


@pytest.mark.parametrize("multiplex", [True, False], ids=["calls-stream", "unary-calls"])
def test_a_call_whose_channel_is_closed_under_it_is_peer_unreachable(make_peer, multiplex):
    # the DHT forgets the channel of a node it gave up on while a resent request may still be in
    # flight on it; that request must fail as PeerUnreachable, not cancel the lookup that awaits it
    a = make_peer()
    b = make_peer(channel_config=ChannelConfig(multiplex=multiplex))
    entered = threading.Event()

    async def hang(request: bytes, ctx):
        entered.set()
        await asyncio.sleep(30)
        return b"late"

    a.server.add_unary("/test.T/Hang", hang)

    async def go():
        channel = b.pool.get(a.addrs[0])
        await channel.info()
        call = asyncio.ensure_future(channel.unary("/test.T/Hang", b"", timeout=20))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        await b.pool.forget(a.peer_id)
        with pytest.raises(PeerUnreachable):
            await asyncio.wait_for(call, 10)
        assert not call.cancelled()

    b.run(go(), timeout=30)


def test_forgetting_a_channel_that_was_replaced_leaves_the_new_one_open(make_peer):
    # a DHT request failed on the channel its caller closed (`forget`) and then forgets that
    # channel in turn: by then the caller dialled afresh, and its new channel must stay open (a
    # revoked peer's fresh dial once failed as "channel closed" instead of hearing "revoked")
    a = make_peer()
    b = make_peer()

    async def go() -> None:
        old = b.pool.get(a.addrs[0])
        await old.info()
        await b.pool.forget(a.peer_id)
        new = b.pool.get(a.addrs[0])
        assert new is not old
        await b.pool.forget(a.peer_id, old)  # the failed request's clean-up, late
        assert b.pool.known(a.peer_id) is new
        await new.info(timeout=10)  # handshake and call on the new channel
        await b.pool.forget(a.peer_id, new)
        assert b.pool.known(a.peer_id) is None

    b.run(go(), timeout=30)


def test_a_first_call_whose_fresh_channel_is_closed_before_the_callee_takes_it_is_peer_unreachable(make_peer):
    # a follower's join went to a leader whose channel the pool closed just after the handshake:
    # the closed Calls stream looked refused, the call was resent as a unary call of its own on the
    # closed channel, and gRPC's UsageError escaped the caller's handling of RPC errors. Closed
    # before its reader task first ran, the stream left the call waiting out its whole timeout.
    a = make_peer()
    b = make_peer()

    async def hang(request: bytes, ctx):
        await asyncio.sleep(30)
        return b"late"

    a.server.add_unary("/test.T/Hang", hang)

    async def go() -> list[BaseException | bytes]:
        outcomes: list[BaseException | bytes] = []
        for _ in range(3):  # a fresh channel each time
            channel = b.pool.get(a.addrs[0])
            await channel.verify()
            call = asyncio.ensure_future(channel.unary("/test.T/Hang", b"", timeout=20))
            await asyncio.sleep(0)  # the call opens its Calls stream; the callee has not taken it yet
            await b.pool.forget(a.peer_id, channel)
            outcomes.append((await asyncio.gather(asyncio.wait_for(call, 10), return_exceptions=True))[0])
        return outcomes

    outcomes = b.run(go(), timeout=60)
    # at once (the call's own timeout is 20 s, the wait for it 10), as a peer out of reach
    assert all(isinstance(o, PeerUnreachable) for o in outcomes), outcomes
