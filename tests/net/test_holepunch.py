"""Hole punching cannot be turned against third parties (docs/relay.md, "Hole punching"): a callee
behind a real relay punches only to the address the relay saw the caller come from, and answers a
bounded number of punches per caller address, per source network and in all; a peer that asks
1,000 times is refused beyond those limits while the relay and the callee keep serving others."""

from __future__ import annotations

import asyncio

import pytest

from swarm.core.errors import ConfigError
from swarm.core.multiaddr import Multiaddr
from swarm.net import relay as relay_mod
from swarm.net.holepunch import PunchGuard, PunchLimits
from swarm.net.nat import NatConfig
from swarm.net.relay import ReservationsConfig

LIMITS = PunchLimits(per_caller=8, per_network=16, total=64, concurrent=1000, window=60.0)


def _private(limits: PunchLimits = LIMITS) -> NatConfig:
    return NatConfig(reachability="private", reservations=ReservationsConfig(target=1), punch_limits=limits)


async def punch_request(relay_addr: Multiaddr, peer_id: str, source: str, named: str | None = None) -> bytes:
    """One punch request from `source` (a loopback address), naming `named` as the caller's address;
    returns the callee's answer line. It never sends SYNC, so the callee never dials."""
    reader, writer = await asyncio.open_connection(relay_addr.host, relay_addr.port, local_addr=(source, 0))
    try:
        writer.write(f"CONNECT {peer_id}:{relay_mod.PUNCH_PORT} HTTP/1.1\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        if head.split()[1] != b"200":
            return head
        writer.write(f"PUNCH {relay_mod.GRPC_PORT} {named or source} 40000\n".encode())
        return await asyncio.wait_for(reader.readline(), 5.0)
    finally:
        writer.close()


def test_a_callee_punches_only_to_the_address_its_relay_saw_the_caller_at(make_peer):
    a = make_peer()  # public: relays
    b = make_peer(initial_peers=a.addrs, nat=_private())
    relay_addr = Multiaddr.parse(a.nat.relay_addr)

    async def go() -> list[bytes]:
        return [await punch_request(relay_addr, b.peer_id, "127.0.0.5", named="127.0.0.9"),  # a third party
                await punch_request(relay_addr, b.peer_id, "127.0.0.5", named="::ffff:127.0.0.5"),
                await punch_request(relay_addr, b.peer_id, "127.0.0.5", named="not-an-ip")]

    third, own, nonsense = a.run(go())
    assert third == b"NO 127.0.0.9 is not the address your relay saw (127.0.0.5)\n"
    assert own.startswith(b"ADDR ")  # its own address, however written: the punch may go ahead
    assert nonsense.startswith(b"NO not-an-ip is not the address your relay saw")
    assert b.nat.punch_guard.refused["not the caller's address"] == 2 and b.nat.punch_guard.admitted == 1


@pytest.mark.timeout(120)
def test_a_thousand_punch_requests_are_refused_beyond_the_limits_and_others_are_still_served(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs, nat=_private())
    relay_addr = Multiaddr.parse(a.nat.relay_addr)
    guard = b.nat.punch_guard
    now = [1000.0]
    guard.clock = lambda: now[0]  # no refill during the run: the counts are exact

    sources = (["127.0.0.2"] * 400  # one address
               + [f"127.0.0.{3 + i // 3}" for i in range(300)]  # 100 addresses of the same /24
               + [f"127.{1 + i // 2}.0.1" for i in range(300)])  # 150 networks

    async def abuse() -> list[bytes]:
        return [await punch_request(relay_addr, b.peer_id, source) for source in sources]

    answers = a.run(abuse(), timeout=110)
    assert len(answers) == 1000
    admitted = [i for i, x in enumerate(answers) if x.startswith(b"ADDR ")]
    assert len(admitted) == 64
    assert admitted[:8] == list(range(8))  # the lone address: its 8
    assert admitted[8:16] == list(range(400, 408))  # its network: 8 more, whoever asks
    assert admitted[16:] == list(range(700, 748))  # everyone: up to 64
    why = [x.decode().split(" (")[0] for x in answers if not x.startswith(b"ADDR ")]
    assert why.count("NO too many punches from your address") == 392
    assert why.count("NO too many punches from your network") == 292
    assert why.count("NO too many punches from all callers") == 252
    assert answers[-1] == b"NO too many punches from all callers (64 per 60 s)\n"
    assert b.peer_id in a.nat.relay.reservations and not a.nat.relay.refused  # the relay refused nothing

    c = make_peer(initial_peers=a.addrs, relay=False)  # another peer: its calls through the relay go on

    async def info():
        return await c.pool.get(b.addrs[0]).info()

    assert c.run(info()).peer_id == b.peer_id
    now[0] += 60.0  # a minute later the counts have refilled
    assert a.run(punch_request(relay_addr, b.peer_id, "127.0.0.2")).startswith(b"ADDR ")


def test_the_punch_guard_counts_per_caller_network_and_all_and_refills_with_time():
    now = [0.0]
    guard = PunchGuard(PunchLimits(per_caller=2, per_network=3, total=4, concurrent=2, window=10.0),
                       clock=lambda: now[0])
    assert guard.admit("10.0.0.1") == "" and guard.admit("10.0.0.1") == ""
    assert guard.admit("10.0.0.2") == "too many punches at once"  # two in progress
    guard.release()
    guard.release()
    assert guard.admit("10.0.0.1") == "too many punches from your address (2 per 10 s)"
    assert guard.admit("10.0.0.2") == ""
    guard.release()
    assert guard.admit("10.0.0.3") == "too many punches from your network (3 per 10 s)"
    assert guard.admit("2001:db8::1") == ""  # another network
    guard.release()
    assert guard.admit("2001:db9::1") == "too many punches from all callers (4 per 10 s)"
    now[0] = 5.0  # half the window: half of each count back
    assert guard.admit("10.0.0.1") == ""
    guard.release()
    assert guard.admit("10.0.0.1") == "too many punches from your address (2 per 10 s)"
    assert guard.admitted == 5 and guard.active == 0
    assert guard.refused == {"too many punches at once": 1, "too many punches from your address": 2,
                             "too many punches from your network": 1, "too many punches from all callers": 1}
    with pytest.raises(ConfigError):
        PunchLimits(total=0)
