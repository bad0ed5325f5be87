"""The DHT across real `python -m swarm` processes: stores and gets from in-test peers, signed records
checked by other processes, gets after SIGKILLing 30% of them, and joining with initial peers down."""

from __future__ import annotations

import dataclasses
import signal
import socket
import time

import msgpack
import pytest
from procs import PeerProcess, start_peers

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, owner_marker
from swarm.dht.ids import DHTID
from swarm.dht.validation import DHTRecord, signed_bytes
from swarm.dht.wire import INVALID, store_item
from swarm.peer import Peer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CLIENT = DHTConfig(request_timeout=1.0, lookup_timeout=5.0, cache_size=0)  # no cache: every get hits the swarm
NOISE = ("Traceback", "Task was destroyed", "Exception ignored")


def dead_addr() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"


@pytest.fixture(scope="module")
def daemons():
    procs = start_peers(6)
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            for stream in (proc.proc.stdout, proc.proc.stderr):
                if stream:
                    stream.close()


def test_a_process_swarm_stores_finds_and_survives_sigkill(daemons):
    addrs = [d.addrs[0] for d in daemons]
    client = Peer(initial_peers=addrs, client_mode=True, dht_config=CLIENT)
    writer = Peer(initial_peers=addrs[:1], dht_config=CLIENT)
    try:
        now = get_dht_time()
        keys = [f"proc-{i}" for i in range(30)]
        assert all(client.dht.store_many(keys, list(range(30)), now + 300))
        for reader in (client, writer):
            found = reader.dht.get_many(keys)
            assert [found[k].value if found[k] else None for k in keys] == list(range(30))
        # a later expiration replaces the earlier value for every latest get
        assert writer.dht.store("proc-versioned", "v1", now + 60)
        assert client.dht.store("proc-versioned", "v2", now + 120)
        assert writer.dht.get("proc-versioned", latest=True) == ("v2", now + 120)
        # the client never entered a routing table: ask the daemons for the nodes nearest to its ID
        client_id = DHTID.from_peer_id(client.peer_id)
        nearest = writer.run(writer.dht.node.find_nearest_nodes([client_id]))[client_id]
        assert nearest and client.peer_id not in {n.peer_id for n in nearest}

        for victim in daemons[1:3]:  # 2 of 6: SIGKILL, no goodbye
            victim.signal(signal.SIGKILL)
            victim.wait(10)
        for reader in (client, writer):
            start = time.monotonic()
            found = reader.dht.get_many(keys)
            assert time.monotonic() - start < CLIENT.lookup_timeout
            assert [found[k].value if found[k] else None for k in keys] == list(range(30))
        assert client.dht.store("after-the-kill", 1, get_dht_time() + 60)
        assert writer.dht.get("after-the-kill", latest=True).value == 1
    finally:
        client.shutdown()
        writer.shutdown()


def test_other_processes_refuse_forged_and_replayed_records_with_a_reason(daemons):
    addrs = [d.addrs[0] for d in daemons if d.proc.poll() is None]
    alice = Peer(initial_peers=addrs[:1], dht_config=CLIENT)
    mallory = Peer(initial_peers=addrs[:1], client_mode=True, dht_config=CLIENT)
    try:
        now = get_dht_time()
        key = "alice-in-processes" + owner_marker(alice.peer_id)
        assert alice.dht.store(key, "genuine", now + 60)
        plain = DHTRecord.create(key, "forged", now + 120)
        forged = dataclasses.replace(
            plain, value=msgpack.packb([plain.value, mallory.identity.sign(signed_bytes(plain, plain.value))]))
        key_id = DHTID.from_bytes(plain.key)
        protocol = mallory.dht.node.protocol
        nearest = mallory.run(mallory.dht.node.find_nearest_nodes([key_id], beam_size=3))[key_id]
        answers = mallory.run(protocol.call_find(nearest[0], [key_id]))
        signed_value = answers[key_id].value.value  # Alice's signed value, as a replica holds it
        replayed = DHTRecord(plain.key, b"", signed_value, now + 600, plain.raw_key)
        daemon_nodes = [n for n in nearest if n.peer_id != alice.peer_id]
        assert daemon_nodes
        for record in (forged, replayed):
            for node in daemon_nodes:
                result = mallory.run(protocol.call_store(node, [store_item(record)]))
                assert result is not None and result[0].status == INVALID
                assert "signature is not" in result[0].reason and alice.peer_id in result[0].reason
        assert mallory.dht.get(key, latest=True) == ("genuine", now + 60)
    finally:
        alice.shutdown()
        mallory.shutdown()


def test_a_daemon_joins_while_some_initial_peers_are_down(daemons):
    live = [d for d in daemons if d.proc.poll() is None]
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", dead_addr(), live[0].addrs[0],
                     dead_addr()) as joined:
        writer = Peer(initial_peers=[live[-1].addrs[0]], client_mode=True, dht_config=CLIENT)
        probe = Peer(initial_peers=joined.addrs, client_mode=True, dht_config=CLIENT)  # knows only the newcomer
        try:
            assert writer.dht.store("join-probe", "hello", get_dht_time() + 60)
            assert probe.dht.get("join-probe") is not None  # the newcomer led it into the swarm
        finally:
            writer.shutdown()
            probe.shutdown()
        assert joined.stop() == 0
        assert not any(noise in joined.stderr_text() for noise in NOISE)


def test_a_daemon_with_no_reachable_initial_peer_exits_2_with_a_clear_error():
    dead = dead_addr()
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", dead, expect_addrs=0) as proc:
        assert proc.wait(20) == 2
        stderr = proc.stderr_text()
        assert "swarm-peer: error: could not join the DHT" in stderr and dead in stderr
        assert not any(noise in stderr for noise in NOISE), stderr
