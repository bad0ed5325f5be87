"""The collector against real in-process peers: it asks each peer for Info, reads a run's progress
reports as the trainers' tracker does (forged or malformed subkeys skipped), and stops showing a
peer that stopped as answering."""

from __future__ import annotations

import json
import subprocess
import sys

from swarm.core.status import PeerStatus
from swarm.core.timeutil import get_dht_time
from swarm.dashboard.collector import Collector, DashboardConfig
from swarm.dashboard.view import DashboardLimits
from swarm.dht.validation import owner_marker
from swarm.optim.progress import PeerProgress
from swarm.peer import Peer
from swarm.proto import peer_pb2


def test_the_collector_reads_peers_and_validated_progress_reports(make_peer):
    serving = make_peer(listen="/ip4/127.0.0.1/tcp/0")
    trainer = make_peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=[serving.addrs[0]])
    leaving = make_peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=[serving.addrs[0]])
    now = get_dht_time()
    report = PeerProgress(trainer.peer_id, 5, 40, 12.5, now, addr=trainer.addrs[0], loss=3.25, target_batch_size=64)
    assert trainer.dht.store("r.progress", report.to_record(), now + 30, subkey=owner_marker(trainer.peer_id))
    # a record in no one's name, and one in the trainer's name that is no progress report
    trainer.dht.store("r.progress", {"epoch": 99, "samples": 1, "sps": 1.0, "time": now}, now + 30, subkey="forged")
    leaving.dht.store("r.progress", {"epoch": "many"}, now + 30, subkey=owner_marker(leaving.peer_id))
    collector = Collector(serving, DashboardConfig(runs=("r",), info_timeout=5.0))

    view = serving.run(collector.acollect(), timeout=30)
    peers = {p["id"]: p for p in view["peers"]}
    assert set(peers) == {serving.peer_id, trainer.peer_id, leaving.peer_id}
    assert peers[trainer.peer_id]["rtt_ms"] > 0 and peers[trainer.peer_id]["roles"] == ["trainer"]
    run = view["runs"][0]
    assert (run["epoch"], run["samples"], run["target"], run["loss"]) == (5, 40, 64, 3.25)
    assert [p["id"] for p in run["peers"]] == [trainer.peer_id]

    leaving.shutdown()
    view = serving.run(collector.acollect(), timeout=30)
    # a peer that left politely is out of the routing table (gone); one that died is unreachable
    assert {p["id"]: p["reachability"] for p in view["peers"]}.get(leaving.peer_id, "unreachable") == "unreachable"
    assert collector.history.to_json()["runs"]["r"]["epoch"] == [5, 5]


def test_serving_the_dashboard_does_not_import_torch():
    # a DHT-only daemon with --dashboard-port stays as light as without it (~50 MB, not ~250)
    code = ("import sys, swarm.cli.dashboard, swarm.dashboard.service, swarm.dashboard.collector; "
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('swarm.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class LyingPeer(Peer):
    """A real peer whose `Info` answers say whatever a hostile peer would."""

    def describe(self) -> peer_pb2.PeerInfo:
        info = super().describe()
        info.started = float("nan")
        info.runs.extend(["bad run", "", "x" * 500, *(f"junk{i}" for i in range(100))])
        info.links.extend(peer_pb2.LinkStat(peer_id=f"12D3KooW{i}", rtt=float("nan") if i % 2 else 1e9,
                                            throughput=-1.0) for i in range(1000))
        info.links.append(peer_pb2.LinkStat(peer_id="<img src=x>", rtt=0.5))
        info.experts.extend(f"ffn.{i}" for i in range(5000))
        info.expert_load.extend(peer_pb2.ExpertLoad(uid=f"ffn.{i}", batches=2**64 - 1, queued=7) for i in range(5000))
        info.rejected.extend(peer_pb2.RejectedAnswers(server=f"12D3KooWs{i}", count=2**64 - 1) for i in range(1000))
        info.forward_calls, info.forward_seconds = 5, float("inf")
        return info


def test_runs_are_found_in_answers_and_a_lying_answer_is_capped_and_checked(make_peer):
    serving = make_peer(listen="/ip4/127.0.0.1/tcp/0")
    trainer = make_peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=[serving.addrs[0]])
    liar = LyingPeer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=[serving.addrs[0]])
    try:
        PeerStatus.of(trainer).join_run("found")  # as its progress tracker does when it starts
        now = get_dht_time()
        report = PeerProgress(trainer.peer_id, 2, 8, 4.0, now, addr=trainer.addrs[0], target_batch_size=64)
        assert trainer.dht.store("found.progress", report.to_record(), now + 30, subkey=owner_marker(trainer.peer_id))
        limits = DashboardLimits(max_runs=4, max_runs_per_peer=8, max_links_per_peer=16, max_experts_per_peer=100)
        collector = Collector(serving, DashboardConfig(info_timeout=5.0, limits=limits))

        view = serving.run(collector.acollect(), timeout=30)  # the run is read as soon as an answer names it
        assert view["runs"][0]["run_id"] == "found" and view["runs"][0]["epoch"] == 2 and not view["runs_named"]
        assert [r["run_id"] for r in view["runs"]] == ["found", "junk0", "junk1", "junk2"]
        peers = {p["id"]: p for p in view["peers"]}
        lying = peers[liar.peer_id]
        assert lying["runs"] == [f"junk{i}" for i in range(5)]  # 8 taken, the 3 malformed left out
        assert lying["uptime_s"] is None and lying["forward_ms"] is None and lying["links"] == 16
        assert all(peers.get(f"12D3KooW{i}", {}).get("link_rtt_ms") is None for i in range(16))  # NaN, 1e9 s
        assert len(view["rejections"]) == 64 and all(r["count"] == 2**53 for r in view["rejections"])
        loads = [row for grid in view["experts"]["grids"] for row in grid["rows"]]
        assert len(loads) == 100 and all(row[2] == 2**53 and row[3] == 7 for row in loads)
        json.dumps(view, allow_nan=False)

        named = Collector(serving, DashboardConfig(runs=("found",), info_timeout=5.0))
        assert [r["run_id"] for r in serving.run(named.acollect(), timeout=30)["runs"]] == ["found"]  # a filter
    finally:
        liar.shutdown()
