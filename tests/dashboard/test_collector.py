"""The collector against real in-process peers: it asks each peer for Info, reads a run's progress
reports as the trainers' tracker does (forged or malformed subkeys skipped), and stops showing a
peer that stopped as answering."""

from __future__ import annotations

import subprocess
import sys

from swarm.core.timeutil import get_dht_time
from swarm.dashboard.collector import Collector, DashboardConfig
from swarm.dht.validation import owner_marker
from swarm.optim.progress import PeerProgress


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
