"""How often a peer writes its progress to the DHT: every `report_period` while the swarm counts
samples towards a target batch; with no target (DiLoCo mode) only when its epoch changes and at
the heartbeat, since no peer's round waits on the others' sample counts. Real peers on loopback;
the writes are counted by the peer's own RPC metrics."""

from __future__ import annotations

import time

import pytest

from swarm import Peer
from swarm.optim import CollaborationConfig
from swarm.optim.tracker import ProgressTracker

pytestmark = pytest.mark.timeout(60)


def _stores(peer) -> int:
    metrics = peer.pool.metrics.methods
    return sum(int(m.ok.value + m.failed.value) for path, m in metrics.items() if path.endswith("/Store"))


def _report_for(peer, run_id: str, config: CollaborationConfig, seconds: float) -> int:
    """Store RPCs the peer made while a trainer updated its progress every 20 ms for `seconds`."""
    tracker = ProgressTracker(peer, run_id, config, addr=str(peer.addrs[0]))
    try:
        peer.run(tracker.astart(), timeout=30)
        before = _stores(peer)
        samples, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            samples += 16
            tracker.update(epoch=0, samples=samples, samples_per_second=800.0, digest="d")
            time.sleep(0.02)  # the training step between two updates
        return _stores(peer) - before
    finally:
        peer.run(tracker.ashutdown(), timeout=10)


def test_without_a_target_batch_progress_is_written_at_the_heartbeat_only(make_peer) -> None:
    peer = make_peer()
    make_peer()  # a second node: the reports are stored on it over RPC
    common = {"report_period": 0.05, "progress_expiration": 30.0}  # heartbeat 10 s: not reached
    large_batch = _report_for(peer, "lb", CollaborationConfig(target_batch_size=10**6, **common), 1.5)
    diloco = _report_for(peer, "dl", CollaborationConfig(**common), 1.5)
    assert large_batch >= 4  # ~30 report periods passed; a busy loop may merge many of them
    assert diloco == 0


def _finds(peer) -> int:
    metrics = peer.pool.metrics.methods
    return sum(int(m.ok.value + m.failed.value) for path, m in metrics.items() if path.endswith("/Find"))


def test_a_replica_follows_the_others_from_its_own_copy_at_once_and_a_client_from_the_network(make_peer) -> None:
    """Three peers (each one of the key's replicas: fewer nodes than `num_replicas`) and a client.
    No read is scheduled during the test (the ETA is far off and `max_refresh_period` is long), so
    a replica that learns of a report learned it from the store that reached its own storage, and
    did so without a Find; the client, which holds no copy, reads the network when asked."""
    peers = [make_peer() for _ in range(3)]
    client = Peer(initial_peers=peers[0].addrs, client_mode=True)
    config = CollaborationConfig(target_batch_size=10**6, report_period=0.02, min_refresh_period=0.02,
                                 max_refresh_period=60.0, progress_expiration=120.0)
    trackers = [ProgressTracker(p, "follow", config, addr=str(p.addrs[0]) if p.addrs else "")
                for p in [*peers, client]]
    try:
        for peer, tracker in zip([*peers, client], trackers, strict=True):
            peer.run(tracker.astart(), timeout=30)
        assert all(peer.run(_holds(peer), timeout=5) for peer in peers)
        assert not client.run(_holds(client), timeout=5)
        finds = [_finds(p) for p in peers]
        network = [t.reads["network"] for t in trackers[1:3]]
        for step in range(1, 6):
            trackers[0].update(epoch=0, samples=16 * step, samples_per_second=800.0, digest="d")
            for peer, tracker in zip(peers[1:], trackers[1:3], strict=True):
                seen = peer.run(tracker.wait_until(lambda p, want=16 * step: p.samples >= want), timeout=10)
                assert seen.samples == 16 * step
        assert [t.reads["network"] for t in trackers[1:3]] == network
        assert all(t.reads["local"] >= 5 for t in trackers[1:3])
        assert [_finds(p) for p in peers[1:]] == finds[1:]  # the progress was never asked of the network
        assert client.run(_client_sees(trackers[3]), timeout=10) == 16 * 5
        assert _finds(client) > 0
    finally:
        for peer, tracker in zip([*peers, client], trackers, strict=True):
            peer.run(tracker.ashutdown(), timeout=10)
        client.shutdown()


async def _holds(peer) -> bool:
    return peer.dht.holds_replica("follow.progress")


async def _client_sees(tracker: ProgressTracker) -> int:
    tracker.request_refresh()
    progress = await tracker.wait_until(lambda p: p.samples >= 80)
    return progress.samples
