"""Attacks 2 and 3: one anonymous caller stuffs a key with megabytes of junk subkeys (so that its
Find answer would pass the message cap) and fills a node's memory with 1 MiB records. The node's
quotas refuse what is past one writer's share, its answers stay within the cap keeping the small
entries, and honest peers keep storing, reading and serving."""

from __future__ import annotations

import os

import pytest
import torch
from attacks import HID, node_of, raw_record, rss_bytes, serve, store_raw
from procs import PeerProcess

from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.dht.wire import REFUSED, STORED
from swarm.moe import RemoteMixtureOfExperts
from swarm.moe.dht_declare import DHTExpertSource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MIB = 1 << 20
CLIENT = DHTConfig(request_timeout=5.0, lookup_timeout=10.0, cache_size=0)


def test_junk_subkeys_cannot_make_a_prefix_unreadable(make_peer) -> None:
    with serve("ffn.[0:2]") as server:
        attacker = make_peer(initial_peers=server.addrs, client_mode=True)
        later = get_dht_time() + 3600
        junk = [raw_record("ffn.", os.urandom(MIB - 100), later, f"junk{i}") for i in range(10)]
        answers = store_raw(attacker, junk, [node_of(server.addrs[0])])
        assert {r.status for r in answers[0]} <= {STORED, REFUSED}

        client = make_peer(initial_peers=server.addrs, client_mode=True, dht_config=CLIENT)
        successors = client.run(DHTExpertSource(client.dht).get_successors(["ffn."]), timeout=30)
        assert successors == {"ffn.": {0: ("ffn.0", server.addrs[0]), 1: ("ffn.1", server.addrs[0])}}
        moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2,
                                     forward_timeout=20)
        assert moe(torch.randn(4, HID)).shape == (4, HID)  # the honest server keeps serving
        assert server.proc.poll() is None


def test_one_caller_cannot_fill_a_nodes_memory(make_peer) -> None:
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "WARNING") as victim:
        attacker = make_peer(initial_peers=victim.addrs, client_mode=True)
        node = node_of(victim.addrs[0])
        before = rss_bytes(victim.pid)
        later = get_dht_time() + 3600
        blob = os.urandom(MIB - 100)
        records = [raw_record(f"fill-{i}", blob, later) for i in range(120)]
        records += [raw_record("fill-dict", blob, later, i) for i in range(40)]
        results = store_raw(attacker, records, [node])[0]
        stored = sum(r.status == STORED for r in results)
        limit = DHTConfig().max_writer_bytes
        assert stored * MIB <= limit + MIB, f"{stored} MiB stored for one caller"
        assert any("limit per writer" in r.reason for r in results if r.status == REFUSED)
        grown = rss_bytes(victim.pid) - before
        assert grown < limit + 64 * MIB, f"the node grew by {grown >> 20} MiB"

        honest = make_peer(initial_peers=victim.addrs, dht_config=CLIENT)  # another caller, its own quota
        assert honest.dht.store("honest-record", {"step": 1}, get_dht_time() + 60)
        reader = make_peer(initial_peers=victim.addrs, client_mode=True, dht_config=CLIENT)
        assert reader.dht.get("honest-record", latest=True).value == {"step": 1}
        assert victim.proc.poll() is None
