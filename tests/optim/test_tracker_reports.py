"""How often a peer writes its progress to the DHT: every `report_period` while the swarm counts
samples towards a target batch; with no target (DiLoCo mode) only when its epoch changes and at
the heartbeat, since no peer's round waits on the others' sample counts. Real peers on loopback;
the writes are counted by the peer's own RPC metrics."""

from __future__ import annotations

import time

import pytest

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
