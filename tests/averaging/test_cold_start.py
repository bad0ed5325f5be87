"""Peers started the way a user starts them (a first peer, then the others given its address as
soon as it prints it), each averaging a fresh tensor with a fresh `Averager` per round and leaving
after its last round: no healthy peer is left out of any round. Real processes on loopback; the
benchmark's own runner (`scripts/bench/bench_cold_start.py`, which runs 50 such starts with the
full 100 MB tensors) with smaller tensors and three starts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_cold_start  # scripts/bench is no package

pytestmark = pytest.mark.timeout(240)


def test_cold_started_peers_are_all_in_every_round_and_a_leaving_peer_fails_nobody() -> None:
    deadline = time.monotonic() + 200
    for _ in range(3):
        run = bench_cold_start.cold_start(peers=4, numel=2_000_000, rounds=3, step_timeout=60.0, deadline=deadline)
        # a failed step is a healthy peer left out: its round's group started without it and it found
        # no other, or a member that finished the round and left cut the others' results short
        assert run.failed == [], [(s["round"], s["peer"], s["seconds"], s["error"]) for s in run.failed]
        assert len(run.steps) == 12
