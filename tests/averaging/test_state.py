"""State transfer: a newcomer downloads tensors + metadata, surviving the death of its source."""

from __future__ import annotations

import signal

import pytest
import torch
from avg_harness import Worker
from worker import state_tensors

from swarm.averaging import Action, FaultPlan, FaultPoint, State, StateServer, load_state_from_peers
from swarm.core.errors import AveragingError
from swarm.peer import Peer

NUMEL = 300_000  # ~1.2 MB in 64 KiB chunks: ~19 chunks


def _serve(index: int, version: str, faults: list | None = None) -> Worker:
    return Worker({"index": index, "seed": 0, "numel": 10, "faults": faults or [],
                   "serve_state": {"seed": 5, "numel": NUMEL, "version": version, "chunk_bytes": 1 << 16}})


@pytest.mark.timeout(90)
def test_download_resumes_from_another_peer_when_its_source_is_killed():
    victim = _serve(0, "ab" * 8, [{"point": "during_state_transfer", "action": "kill", "after": 4}])
    other = _serve(1, "ab" * 8)
    try:
        for w in (victim, other):
            ready = w.next_event(60)
            w.addr, w.peer_id = ready["addr"], ready["peer_id"]
        with Peer(client_mode=True) as newcomer:
            got = load_state_from_peers(newcomer, "test", [victim.addr, other.addr], timeout=30)
        assert victim.proc.wait(10) == -signal.SIGKILL
        assert got.sources == [victim.peer_id, other.peer_id]  # resumed at the same offset (same version)
        assert got.metadata == {"step": 5, "name": "test"}
        for a, b in zip(got.tensors, state_tensors(5, NUMEL), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    finally:
        victim.close()
        other.close()


@pytest.mark.timeout(60)
def test_download_restarts_when_the_next_source_holds_another_version():
    with Peer() as a, Peer() as b, Peer(client_mode=True) as newcomer:
        big = torch.randn(200_000)
        plan = FaultPlan().add(FaultPoint.DURING_STATE_TRANSFER, Action.DROP, after=2)
        StateServer(a, "s", lambda: State({"from": "a"}, [big + 1]), chunk_bytes=1 << 16, faults=plan)
        StateServer(b, "s", lambda: State({"from": "b"}, [big, torch.ones(3)]), chunk_bytes=1 << 16)
        got = load_state_from_peers(newcomer, "s", [a.addrs[0], b.addrs[0]], timeout=20)
        assert got.metadata == {"from": "b"} and got.sources == [a.peer_id, b.peer_id]
        assert torch.equal(got.tensors[0], big) and torch.equal(got.tensors[1], torch.ones(3))
        with pytest.raises(AveragingError, match="could not download"):
            load_state_from_peers(newcomer, "nothing-here", [a.addrs[0]], timeout=5)
