"""Relays and reachability between real peers on loopback (docs/relay.md): a peer that says it is
private holds reservations on relays, is reached through them for unary calls and for the bulk
side channel, moves to another relay when one stops, and a relay bounds what one address can take."""

from __future__ import annotations

import asyncio
import socket

import pytest
from proxy import LoopbackProxy
from test_bulk import call, serve_echo

from swarm.core.errors import MultiaddrError, PeerUnreachable
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.dht.wire import bare
from swarm.net import relay as relay_mod
from swarm.net.nat import NatConfig
from swarm.net.reachability import DIAL_BACK
from swarm.net.relay import Relay, RelayConfig, ReservationsConfig
from swarm.proto import relay_pb2

PRIVATE = NatConfig(reachability="private", first_reservation_timeout=10.0,
                    reservations=ReservationsConfig(target=2, retry_after=60.0))


def wait_until(peer, predicate, timeout: float = 15.0) -> bool:
    """Polls `predicate` on the peer's loop every 50 ms, for at most `timeout` seconds."""

    async def go() -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    return peer.run(go(), timeout=timeout + 5)


def test_relayed_multiaddrs_parse_print_and_travel_bare():
    relay_id, peer_id = Identity.generate().peer_id, Identity.generate().peer_id
    text = f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}"
    addr = Multiaddr.parse(text)
    assert (addr.host, addr.port, addr.relay_id, addr.peer_id) == ("10.0.0.1", 4001, relay_id, peer_id)
    assert str(addr) == text
    assert addr.relay == Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}")
    assert Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}").circuit(peer_id) == addr
    assert bare(text) == f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit"
    assert Multiaddr.parse(bare(text)).with_peer_id(peer_id) == addr
    assert bare(f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}") == "/ip4/10.0.0.1/tcp/4001"
    for wrong in (f"/ip4/10.0.0.1/tcp/4001/p2p-circuit/p2p/{peer_id}",
                  f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/notapeer",
                  f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit/quic"):
        with pytest.raises(MultiaddrError):
            Multiaddr.parse(wrong)


def test_reachability_public_on_loopback_private_when_nobody_can_dial_back(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs)
    assert b.nat.status == "public" and a.peer_id in b.nat.reachability.confirmed
    assert b.describe().reachability == "public"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nobody listens on: the announced address is a lie
    port = closed.getsockname()[1]
    try:
        c = make_peer(initial_peers=a.addrs, announce=[f"/ip4/127.0.0.1/tcp/{port}"], relay=False)
        assert c.nat.status == "private"
        assert "cannot connect" in c.nat.reachability.refuted[a.peer_id]
        assert c.nat.relay is None
    finally:
        closed.close()
    d = make_peer(initial_peers=a.addrs, announce=["/ip4/10.99.0.1/tcp/4001"])  # never dialled: not where d is
    assert d.nat.status == "private"
    assert "comes from 127.0.0.1" in d.nat.reachability.refuted[a.peer_id]
    # an address where another peer (b) answers: the TLS session there does not prove e's PeerID
    e = make_peer(initial_peers=a.addrs, announce=[bare(b.addrs[0])], relay=False)
    assert e.nat.status == "private"
    assert f"does not prove {e.peer_id}" in e.nat.reachability.refuted[a.peer_id]


def test_a_private_peer_is_reached_through_its_relay_for_calls_and_bulk_streams(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    serve_echo(b)
    assert b.addrs == [str(Multiaddr.parse(a.nat.relay_addr).circuit(b.peer_id))]
    assert "reachable through 1 relay" in b.nat.plan()
    c = make_peer(initial_peers=a.addrs, relay=False)

    async def info():
        return await c.pool.get(b.addrs[0]).info()

    found = c.run(info())
    assert found.peer_id == b.peer_id and found.reachability == "private" and list(found.relays) == [a.peer_id]
    big = bytes(range(256)) * 4096  # 1 MiB, both ways through the relay
    before = a.nat.relay.spliced_bytes
    assert call(c, b, [b"abc", big]) == [b"cba", big[::-1], f"2 from {c.peer_id[-6:]}".encode()]
    assert c.pool.known(b.peer_id).bulk_reachable is True  # the bulk side channel, through a circuit too
    assert wait_until(c, lambda: a.nat.relay.spliced_bytes >= before + 2 * len(big))


def test_the_relay_sees_no_plaintext_and_the_callee_must_prove_its_peer_id(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    serve_echo(b)
    seen = bytearray()
    original = relay_mod.splice

    async def tapped(ar, aw, br, bw, bucket=None, count=None):  # records what the relay carries, for this test only
        class Tap:
            def __init__(self, reader):
                self.reader = reader

            async def read(self, n):
                data = await self.reader.read(n)
                seen.extend(data)
                return data

        return await original(Tap(ar), aw, Tap(br), bw, bucket, count)

    relay_mod.splice = tapped
    try:
        c = make_peer(initial_peers=a.addrs, relay=False)
        marker = b"plaintext-marker-" * 64
        assert call(c, b, [marker])[0] == marker[::-1]
    finally:
        relay_mod.splice = original
    assert len(seen) > len(marker) and marker[:32] not in seen and marker[::-1][:32] not in seen
    impostor = Identity.generate().peer_id  # nobody reserved this PeerID on the relay

    async def dial_impostor():
        return await c.pool.get(Multiaddr.parse(a.nat.relay_addr).circuit(impostor)).info(timeout=3)

    with pytest.raises(PeerUnreachable):
        c.run(dial_impostor())


def test_a_private_peer_moves_to_another_relay_when_its_relay_stops(make_peer):
    relays = [make_peer(), make_peer()]
    relays.append(make_peer(initial_peers=relays[0].addrs))
    b = make_peer(initial_peers=relays[0].addrs + relays[1].addrs, nat=PRIVATE)
    assert wait_until(b, lambda: len(b.addrs) == 2)
    held = {Multiaddr.parse(x).relay_id for x in b.addrs}
    victim = next(r for r in relays if r.peer_id in held)
    victim.shutdown()  # its relay closes every reservation
    assert wait_until(b, lambda: len(b.addrs) == 2 and victim.peer_id not in {Multiaddr.parse(x).relay_id
                                                                             for x in b.addrs})
    c = make_peer(initial_peers=[x for x in relays[2].addrs], relay=False)
    for addr in b.addrs:
        async def info(addr=addr):
            return await c.pool.get(addr).info()
        assert c.run(info()).peer_id == b.peer_id


def test_relay_off_and_client_mode(make_peer):
    a = make_peer(relay="off")
    assert a.nat.relay is None and a.nat.relay_addr == ""
    b = make_peer(initial_peers=a.addrs)

    async def ask():
        return await b.pool.get(a.addrs[0]).unary(DIAL_BACK, relay_pb2.DialBackRequest(), relay_pb2.DialBackResponse)

    assert b.run(ask()).relay == ""
    client = make_peer(initial_peers=b.addrs, client_mode=True)
    assert client.nat is None and client.describe().reachability == ""

    async def info():
        return await client.pool.get(b.addrs[0]).info()

    assert client.run(info()).peer_id == b.peer_id


@pytest.mark.timeout(60)
def test_a_private_peer_with_no_relay_to_find_starts_without_waiting_for_one(make_peer):
    a = make_peer(relay="off")  # the only peer it knows does not relay
    nat = NatConfig(reachability="private", first_reservation_timeout=600.0)  # the old start waited this long
    b = make_peer(initial_peers=a.addrs, nat=nat)
    assert b.nat.reservations.searched_in_vain and not b.nat.reservations.addresses
    assert Multiaddr.parse(b.addrs[0]).relay_id is None  # still its direct address: nothing better yet
    assert "no relay reachable yet" in b.nat.plan()


async def _reserve(relay_addr: Multiaddr, identity: Identity, source: str) -> tuple[bytes, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(relay_addr.host, relay_addr.port, local_addr=(source, 0))
    writer.write(b"RESERVE\n")
    nonce = bytes.fromhex((await reader.readline())[6:].strip().decode())
    signature = identity.sign(relay_mod.reserve_payload(nonce, relay_addr.peer_id or ""))
    writer.write(f"{identity.peer_id} {signature.hex()}\n".encode())
    return await reader.readline(), writer


def test_a_relay_refuses_an_abuser_beyond_its_limits_and_keeps_serving_others(make_peer):
    limits = RelayConfig(max_reservations=16, max_reservations_per_ip=4, max_circuits_per_ip=8,
                         max_pending_per_ip=8, handshake_timeout=2.0, accept_timeout=2.0)
    a = make_peer(nat=NatConfig(relay="on", relay_limits=limits))
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    relay: Relay = a.nat.relay
    relay_addr = Multiaddr.parse(a.nat.relay_addr)
    abuser = "127.0.0.2"  # another loopback address: the abuser's limits are not the others'

    async def abuse():
        answers, writers = [], []
        for _ in range(1000):
            answer, writer = await _reserve(relay_addr, Identity.generate(), abuser)
            answers.append(answer)
            writers.append(writer)
            if not answer.startswith(b"OK"):
                writer.close()
        circuits = []
        for _ in range(1000):  # circuits to b that then stay open, saying nothing
            reader, writer = await asyncio.open_connection(relay_addr.host, relay_addr.port, local_addr=(abuser, 0))
            writer.write(f"CONNECT {b.peer_id}:{relay_mod.GRPC_PORT} HTTP/1.1\r\n\r\n".encode())
            status = (await reader.readuntil(b"\r\n\r\n")).split()[1]
            circuits.append((status, writer))
            if status != b"200":
                writer.close()
        return answers, writers, circuits

    answers, writers, circuits = a.run(abuse(), timeout=120)
    try:
        assert sum(x.startswith(b"OK") for x in answers) == 4
        assert sum(b"too many reservations from your address" in x for x in answers) == 996
        statuses = [status for status, _ in circuits]
        assert statuses.count(b"200") == 8 and statuses.count(b"429") == 992
        assert relay.refused["reservations per ip"] == 996 and relay.refused["circuits per ip"] == 992
        c = make_peer(initial_peers=a.addrs, relay=False)  # from 127.0.0.1: served as ever

        async def info():
            return await c.pool.get(b.addrs[0]).info()

        assert c.run(info()).peer_id == b.peer_id
        assert b.peer_id in relay.reservations
    finally:
        for w in writers + [w for _, w in circuits]:
            w.close()


def test_a_relay_answers_bad_input_clearly_and_loses_nothing(make_peer):
    a = make_peer(nat=NatConfig(relay="on", relay_limits=RelayConfig(handshake_timeout=1.0)))
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    relay: Relay = a.nat.relay
    relay_addr = Multiaddr.parse(a.nat.relay_addr)

    async def exchange(first: bytes, then: bytes = b"") -> bytes:
        reader, writer = await asyncio.open_connection(relay_addr.host, relay_addr.port)
        writer.write(first)
        if then:
            await reader.readline()  # the nonce
            writer.write(then)
        answer = await asyncio.wait_for(reader.read(200), 5)
        writer.close()
        return answer

    async def go():
        return [
            await exchange(b"HELLO\n"),  # not a request: closed without an answer
            await exchange(b"RESERVE\n", f"{b.peer_id} {'00' * 64}\n".encode()),  # a signature that is not b's
            await exchange(b"RESERVE\n", b"nonsense\n"),
            await exchange(f"CONNECT {Identity.generate().peer_id}:1 HTTP/1.1\r\n\r\n".encode()),
            await exchange(f"CONNECT {b.peer_id}:notaport HTTP/1.1\r\n\r\n".encode()),
            await exchange(b"ACCEPT 00ff\n"),  # no such circuit
            await exchange(b"CONNECT " + b"x" * 5000 + b"\n"),  # a line longer than the relay reads
        ]

    answers = a.run(go())
    assert answers[0] == b"" and answers[5] == b"" and answers[6] == b""
    assert answers[1] == answers[2] == b"NO bad signature\n"
    assert answers[3].startswith(b"HTTP/1.1 404") and answers[4].startswith(b"HTTP/1.1 404")
    assert relay.refused["bad request"] == 1 and relay.refused["bad signature"] == 2
    assert relay.refused["unknown circuit"] == 1 and relay.refused["no reservation"] == 2
    assert b.peer_id in relay.reservations  # the peer that did reserve lost nothing

    async def info():
        return await b.pool.get(b.addrs[0]).info()  # b through its own relay: still served

    assert b.run(info()).peer_id == b.peer_id


def test_relay_and_nat_settings_are_checked():
    from swarm.core.errors import ConfigError

    for bad in ({"max_reservations": 0}, {"max_bytes_per_s": -1.0}, {"accept_timeout": 0}):
        with pytest.raises(ConfigError):
            RelayConfig(**bad)
    for bad in ({"reachability": "maybe"}, {"relay": "sometimes"}, {"relay_port": 70000}):
        with pytest.raises(ConfigError):
            NatConfig(**bad)
    with pytest.raises(ConfigError):
        ReservationsConfig(target=0)


def test_the_bandwidth_share_paces_every_circuit_together():
    bucket = relay_mod.TokenBucket(rate=1_000_000)  # 1 MB/s, a burst of one 256 KiB chunk
    start = bucket.stamp
    assert bucket.debit(bucket.capacity, start) == 0.0  # the burst goes at once
    assert bucket.debit(500_000, start) == pytest.approx(0.5)  # then each byte waits its turn
    assert bucket.debit(500_000, start + 0.5) == pytest.approx(0.5)  # two circuits share one rate
    assert bucket.debit(1, start + 100) == 0.0  # idle time refills, up to the burst only
    assert bucket.tokens == bucket.capacity - 1
    assert relay_mod.TokenBucket(rate=None).debit(10**9, 0.0) == 0.0


def test_a_reservation_busy_with_circuits_still_keeps_alive(make_peer):
    a = make_peer(nat=NatConfig(relay="on", relay_limits=RelayConfig(reservation_ttl=1.5)))
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    relay: Relay = a.nat.relay
    held = relay.reservations[b.peer_id]
    relay_addr = Multiaddr.parse(a.nat.relay_addr)

    async def busy() -> int:  # circuits to b, one after another, for twice the reservation's ttl
        loop = asyncio.get_running_loop()
        end, opened = loop.time() + 3.0, 0
        while loop.time() < end and opened < 5000:
            reader, writer = await asyncio.open_connection(relay_addr.host, relay_addr.port)
            writer.write(f"CONNECT {b.peer_id}:{relay_mod.GRPC_PORT} HTTP/1.1\r\n\r\n".encode())
            await reader.readuntil(b"\r\n\r\n")
            writer.close()
            opened += 1
        return opened

    assert a.run(busy(), timeout=30) > 3
    assert relay.reservations.get(b.peer_id) is held  # the same reservation: its PINGs kept coming


@pytest.mark.timeout(90)
def test_reachability_is_rechecked_a_forwarded_port_goes_direct_and_a_closed_one_back_to_relays(make_peer):
    a = make_peer()  # public: it relays and dials back
    router = LoopbackProxy(None)  # the "router's" public port: nothing forwarded yet (it closes each connection)
    try:
        announced = f"/ip4/127.0.0.1/tcp/{router.port}"
        nat = NatConfig(recheck_interval=0.3, recheck_max=0.6, reservations=ReservationsConfig(target=1))
        c = make_peer(initial_peers=a.addrs, announce=[announced], nat=nat)
        assert c.nat.status == "private" and c.nat.relay is None
        assert Multiaddr.parse(c.addrs[0]).relay_id == a.peer_id and c.peer_id in a.nat.relay.reservations
        seen: list[list[str]] = []
        c.nat.on_addrs_changed.append(seen.append)

        router.target = ("127.0.0.1", c.server.port)  # the port gets forwarded: the watcher finds out by itself
        assert wait_until(c, lambda: c.nat.status == "public", timeout=20)
        assert wait_until(c, lambda: c.peer_id not in a.nat.relay.reservations)  # the reservation is dropped
        assert c.addrs == [f"{announced}/p2p/{c.peer_id}"] and seen[-1] == c.addrs
        assert c.nat.reservations is None and c.nat.relay is not None  # reachable now: it relays for others

        async def info():
            return await a.pool.get(c.addrs[0]).info()
        assert a.run(info()).peer_id == c.peer_id  # dialed directly, through the forwarded port

        router.target = None  # the forwarding is gone again
        assert wait_until(c, lambda: c.nat.status == "private", timeout=20)
        assert wait_until(c, lambda: bool(c.addrs) and Multiaddr.parse(c.addrs[0]).relay_id == a.peer_id)
        assert c.nat.relay is None and c.peer_id in a.nat.relay.reservations
    finally:
        for peer in (locals().get("c"), a):  # their connections through the router end first
            if peer is not None:
                peer.shutdown()
        router.close()


@pytest.mark.timeout(60)
def test_a_hole_punch_request_is_checked_and_a_caller_without_a_public_address_stays_relayed(make_peer):
    from swarm.net import holepunch

    a = make_peer()
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    relayed = Multiaddr.parse(b.addrs[0])
    assert b.nat.public_ip() is None  # on loopback there is no NAT to punch through: nobody tries

    async def punch_to(port: int) -> str:
        try:
            await holepunch.punch(relayed, port, "127.0.0.1")
        except PeerUnreachable as e:
            return str(e)
        return "punched"

    assert "not a port this peer serves" in b.run(punch_to(4242))  # never a way into its LAN

    async def garbage() -> bytes:
        sock = await relay_mod.open_circuit(relayed, relay_mod.PUNCH_PORT, 5.0)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"PUNCH everything now please\n")
        line = await asyncio.wait_for(reader.readline(), 5.0)
        writer.close()
        return line

    assert b.run(garbage()) == b"NO bad request\n"
    paths = holepunch.DirectPaths(lambda: None)  # no public address known: straight through the relay

    async def through_relay() -> bool:
        sock = await paths.dial(relayed, b.server.bulk.port, 5.0)
        sock.close()
        return True

    assert b.run(through_relay()) and paths.relayed == {b.peer_id: 1} and not paths.direct and not paths.failed

    async def info():
        return await a.pool.get(b.addrs[0]).info()
    assert a.run(info()).peer_id == b.peer_id  # and plain relayed calls work as before
