"""Averaging and state transfer with peers behind relays, on loopback (docs/relay.md): two peers
that say they are private, reached only through their relays, average exactly with two public
ones, and a private peer hands its state to a newcomer."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm.averaging import Averager, State, StateServer, load_state_from_peers
from swarm.core.multiaddr import Multiaddr
from swarm.net.nat import NatConfig
from swarm.net.relay import ReservationsConfig

PRIVATE = NatConfig(reachability="private", reservations=ReservationsConfig(target=1))


def steps(averagers: list[Averager], timeout: float) -> list[object]:
    out: list[object] = [None] * len(averagers)

    def run(i: int) -> None:
        try:
            out[i] = averagers[i].step(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


@pytest.mark.timeout(90)
def test_two_relayed_and_two_public_peers_average_exactly(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs)
    c = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    d = make_peer(initial_peers=b.addrs, nat=PRIVATE)
    group = [a, b, c, d]
    assert all(Multiaddr.parse(p.addrs[0]).relay_id for p in (c, d))
    inputs = [torch.randn(50_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    tensors = [[x.clone()] for x in inputs]
    addrs = [p.addrs[0] for p in group]
    averagers = [Averager(p, t, prefix="relayed", target_group_size=4, initial_group=addrs)
                 for p, t in zip(group, tensors, strict=True)]
    results = steps(averagers, timeout=30)
    assert all(not isinstance(r, Exception) for r in results), results
    exact = sum(inputs) / 4
    for t in tensors:
        assert float((t[0] - exact).abs().max()) <= 1e-5
    assert all(torch.equal(tensors[0][0], t[0]) for t in tensors)
    relayed = sum(p.nat.relay.spliced_bytes for p in (a, b) if p.nat.relay is not None)
    assert relayed > 2 * 50_000 * 4  # the private peers' parts went through the relays


@pytest.mark.timeout(60)
def test_a_relayed_peer_hands_its_state_to_a_newcomer(make_peer):
    a = make_peer()
    c = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    big = torch.randn(300_000)
    StateServer(c, "s", lambda: State({"step": 7}, [big, torch.ones(3)]), chunk_bytes=1 << 16)
    newcomer = make_peer(client_mode=True)
    got = load_state_from_peers(newcomer, "s", [c.addrs[0]], timeout=20)
    assert got.metadata == {"step": 7} and got.sources == [c.peer_id]
    assert torch.equal(got.tensors[0], big) and torch.equal(got.tensors[1], torch.ones(3))
