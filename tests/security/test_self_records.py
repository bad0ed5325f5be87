"""Records a peer makes about itself, attacked by a stranger: training progress and averaging
sign-ups. Unsigned stores under the victim's PeerID with a later expiration (the format these
records had before they were signed) replace the victim's entry on every node, and an invented
peer inflates the swarm; forged ones under the victim's owner marker are refused by the nodes.
Each record is signed by its peer under its `owner_marker` subkey and readers ignore any other
subkey, so the reader sees the victim's own progress and sign-up, and nobody else."""

from __future__ import annotations

import msgpack
import pytest
from attacks import nodes_for, raw_record, store_raw
from procs import start_peers

from swarm.averaging.election import DHTElection
from swarm.averaging.group import MemberInfo
from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, owner_marker
from swarm.dht.wire import STORED
from swarm.optim import CollaborationConfig
from swarm.optim.tracker import ProgressTracker, progress_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
CLIENT = DHTConfig(request_timeout=2.0, lookup_timeout=10.0, cache_size=0)
CONFIG = CollaborationConfig(target_batch_size=1000, report_period=0.2, progress_expiration=60.0)


def test_a_stranger_cannot_overwrite_or_invent_progress_and_sign_ups(make_peer) -> None:
    daemons = start_peers(2, "--log-level", "WARNING")
    try:
        addrs = [d.addrs[0] for d in daemons]
        victim = make_peer(initial_peers=addrs, dht_config=CLIENT)
        attacker = make_peer(initial_peers=addrs, client_mode=True, dht_config=CLIENT)
        reader = make_peer(initial_peers=addrs, client_mode=True, dht_config=CLIENT)
        tracker = ProgressTracker(victim, "run", CONFIG, addr=victim.addrs[0])
        tracker.update(epoch=2, samples=10, samples_per_second=5.0, digest="d")
        victim.run(tracker.astart(), timeout=30)  # its first report is stored before its first read
        me = MemberInfo(victim.peer_id, victim.addrs[0])
        election = DHTElection(victim.dht, "avg")
        victim.run(election.begin(me, get_dht_time() + 60), timeout=30)

        fake_addr = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
        invented = Identity.generate().peer_id
        later = get_dht_time() + 120  # within the nodes' horizon, after the victim's records
        sooner = get_dht_time() + 30  # an earlier sign-up leads
        forged_progress = msgpack.packb({"epoch": 10**6, "samples": 10**6, "sps": 1e6, "time": get_dht_time(),
                                         "client": False, "addr": fake_addr, "digest": "evil"})
        forged_signup = msgpack.packb({"addr": fake_addr, "client_mode": False, "ready_at": 0.0, "looking": True})
        unsigned = [
            raw_record(progress_key("run"), forged_progress, later, victim.peer_id),
            raw_record(progress_key("run"), forged_progress, later, invented),
            raw_record("avg.group.0", forged_signup, sooner, victim.peer_id),
            raw_record("avg.group.0", forged_signup, sooner, invented),
        ]
        forged = [
            raw_record(progress_key("run"), forged_progress, later, owner_marker(victim.peer_id)),
            raw_record("avg.group.0", forged_signup, sooner, owner_marker(victim.peer_id)),
            raw_record("avg.group.0", forged_signup, sooner, owner_marker(invented)),
        ]
        for key in (progress_key("run"), "avg.group.0"):
            nodes = nodes_for(attacker, key)
            answers = store_raw(attacker, [r for r in forged if r.raw_key == unsigned_key(key)], nodes)
            assert all(r.status != STORED and "signature" in r.reason for results in answers for r in results)
            store_raw(attacker, [r for r in unsigned if r.raw_key == unsigned_key(key)], nodes)

        watcher = ProgressTracker(reader, "run", CONFIG)
        reader.run(watcher.astart(), timeout=30)
        reports = {r.peer_id: r for r in watcher.reports()}
        assert set(reports) == {victim.peer_id, reader.peer_id}
        assert (reports[victim.peer_id].epoch, reports[victim.peer_id].samples) == (2, 10)
        assert reports[victim.peer_id].addr == victim.addrs[0]
        assert watcher.progress.epoch == 2

        looking = DHTElection(reader.dht, "avg")
        someone = MemberInfo(reader.peer_id, client_mode=True)
        leader = reader.run(looking.leader(someone, set()), timeout=30)
        assert set(looking.declared(someone)) == {victim.peer_id}
        assert leader is not None and (leader.peer_id, leader.addr) == (victim.peer_id, victim.addrs[0])
        assert all(d.proc.poll() is None for d in daemons)
    finally:
        for daemon in daemons:
            daemon.__exit__(None, None, None)


def unsigned_key(key: str) -> bytes:
    return raw_record(key, b"", 0.0).raw_key
