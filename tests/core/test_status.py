"""PeerStatus: the runs and rejected expert answers a peer's `Info` answer carries, each capped."""

from __future__ import annotations

from swarm.core.identity import Identity
from swarm.core.services import Services
from swarm.core.status import MAX_REJECTING, MAX_RUNS, PeerStatus


class _Owner:
    def __init__(self) -> None:
        self.services = Services()


def test_runs_are_kept_while_a_tracker_of_them_lives_and_are_capped():
    owner = _Owner()
    status = PeerStatus.of(owner)
    assert PeerStatus.of(owner) is status  # one per peer
    status.join_run("a")
    status.join_run("a")  # two trackers of one run
    status.leave_run("a")
    assert status.runs == ["a"]
    status.leave_run("a")
    status.leave_run("never-joined")
    assert status.runs == []
    for i in range(MAX_RUNS + 5):
        status.join_run(f"r{i}")
    assert status.runs == [f"r{i}" for i in range(MAX_RUNS)]


def test_rejected_answers_are_counted_per_server_peer_id_and_the_oldest_servers_forgotten():
    status = PeerStatus()
    server = Identity.generate().peer_id
    status.answer_rejected(f"/ip4/127.0.0.1/tcp/5/p2p/{server}")
    status.answer_rejected(f"/ip4/10.0.0.1/tcp/7/p2p/{server}")  # the same server at another address
    status.answer_rejected("not a multiaddr")
    assert status.rejected == {server: 2, "not a multiaddr": 1}
    for i in range(MAX_REJECTING):
        status.answer_rejected(f"s{i}")
    assert len(status.rejected) == MAX_REJECTING and server not in status.rejected
