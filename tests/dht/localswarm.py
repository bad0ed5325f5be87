"""Helpers for DHT tests with real peers in this process: many peers can share one event-loop thread."""

from __future__ import annotations

import time
from collections.abc import Callable

from swarm.dht import DHTConfig
from swarm.peer import Peer

# short timeouts so that tests about dead peers stay quick; intervals long enough to stay out of the way
FAST = DHTConfig(request_timeout=1.0, lookup_timeout=5.0)


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Polls `condition` until it holds or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class Swarm:
    """Peers in this process; all after the first share the first one's event-loop thread."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []

    def add(self, *, initial: list[str] | None = None, config: DHTConfig = FAST, **kwargs) -> Peer:
        """A new peer joining through the first one (or through `initial`); kwargs go to `Peer`."""
        if initial is None:
            initial = [self.peers[0].addrs[0]] if self.peers else []
        if self.peers:
            kwargs.setdefault("loop", self.peers[0].loop)
        peer = Peer(initial_peers=initial, dht_config=config, **kwargs)
        self.peers.append(peer)
        return peer

    def grow(self, count: int, config: DHTConfig = FAST) -> list[Peer]:
        return [self.add(config=config) for _ in range(count)]

    def kill(self, peer: Peer) -> None:
        """Stops a peer as a crash would: it says no goodbye, its server goes away, others find it dead."""
        if not peer.dht.node.closed:  # not stopped already
            peer.run(peer.dht.node.shutdown(leave=False))
        peer.shutdown()

    def close(self) -> None:
        """Stops every peer as `kill` does (no goodbyes: a teardown need not wait on links a test
        broke), the owner of the shared loop last; a peer failing to stop is reported."""
        errors = []
        for peer in reversed(self.peers):
            try:
                self.kill(peer)
            except Exception as e:  # noqa: BLE001 - stop the others first, then report
                errors.append(e)
        self.peers.clear()
        if errors:
            raise RuntimeError(f"{len(errors)} peers failed to shut down: {errors[0]!r}")
