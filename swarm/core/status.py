"""PeerStatus: what a peer's own components tell others about it through its ``Info`` answer.

The training runs it reports progress in (a `swarm.optim` tracker adds its run) and the expert
servers whose answers its mixtures rejected (`swarm.moe.client`'s checks count each one). The
peer's ``Info`` answer carries them (`swarm.peer.Peer.describe`), and the swarm's page shows them
(docs/operations.md, "Dashboard"). One per peer, in `peer.services`; every part is capped, so a
long-lived peer that meets many runs or servers keeps a bounded record.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

from swarm.core.multiaddr import Multiaddr, MultiaddrError
from swarm.core.services import Services

__all__ = ["MAX_REJECTING", "MAX_RUNS", "PeerStatus"]

MAX_RUNS = 16
"""Training runs one peer reports (the first joined kept)."""
MAX_REJECTING = 64
"""Expert servers one peer counts rejected answers of (the least recently rejected forgotten first)."""


class _ServicesOwner(Protocol):
    """What `PeerStatus.of` needs of a peer (a `swarm.Peer`, or any `NetworkHandle`)."""

    @property
    def services(self) -> Services: ...


class PeerStatus:
    """Runs and rejected expert answers of one peer (see the module docstring); any thread may
    update it (a mixture counts on the training thread, ``Info`` reads on the peer's loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, int] = {}
        self._rejected: OrderedDict[str, int] = OrderedDict()

    @classmethod
    def of(cls, peer: _ServicesOwner) -> PeerStatus:
        """The peer's status, made on first use."""
        return peer.services.get_or_create(cls, cls)

    def join_run(self, run_id: str) -> None:
        """This peer reports progress in `run_id` (counted: two trackers of one run need two leaves)."""
        with self._lock:
            if run_id in self._runs or len(self._runs) < MAX_RUNS:
                self._runs[run_id] = self._runs.get(run_id, 0) + 1

    def leave_run(self, run_id: str) -> None:
        with self._lock:
            count = self._runs.get(run_id, 0) - 1
            if count > 0:
                self._runs[run_id] = count
            else:
                self._runs.pop(run_id, None)

    @property
    def runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def answer_rejected(self, server_addr: str) -> None:
        """An answer of an expert at `server_addr` (its multiaddr) failed this peer's checks."""
        try:
            server = Multiaddr.parse(server_addr).peer_id or server_addr
        except MultiaddrError:
            server = server_addr
        with self._lock:
            self._rejected[server] = self._rejected.pop(server, 0) + 1
            while len(self._rejected) > MAX_REJECTING:
                self._rejected.popitem(last=False)

    @property
    def rejected(self) -> dict[str, int]:
        """Server PeerID -> answers rejected so far."""
        with self._lock:
            return dict(self._rejected)
