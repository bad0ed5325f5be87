"""`swarm-peer --metrics-port`: a real daemon's Prometheus endpoint moves with real traffic."""

import socket
import urllib.request

import pytest
from procs import PeerProcess

from swarm.core.errors import InvalidRequest
from swarm.peer import Peer

INFO = ("method", "/swarm.Peer/Info")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def test_daemon_metrics_count_rpcs_latency_and_bytes(parse):
    port = free_port()
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), ready_timeout=60) as daemon:
        before = parse(scrape(port))
        peer_id = daemon.addrs[0].rsplit("/", 1)[1]
        assert any(name == "swarm_peer_info" and ("peer_id", peer_id) in labels for name, labels in before)
        known = [v for (name, _), v in before.items() if name == "swarm_known_peers"]
        assert known == [0]  # alone: an empty routing table (DHT) or no channels (no DHT yet)
        assert before[("swarm_averaging_rounds_total", (("outcome", "succeeded"),))] == 0
        assert before[("process_resident_memory_bytes", ())] > 0
        assert before.get(("swarm_rpc_server_calls_total", (INFO, ("outcome", "ok"))), 0) == 0

        with Peer(client_mode=True) as caller:
            channel = caller.pool.get(daemon.addrs[0])
            for _ in range(3):
                caller.run(channel.info(timeout=30), timeout=60)
            client = parse(caller.pool.metrics.registry.render())

        after = parse(scrape(port))
        assert after[("swarm_rpc_server_calls_total", (INFO, ("outcome", "ok")))] == 3
        assert after[("swarm_rpc_server_latency_seconds_count", (INFO,))] == 3
        assert after[("swarm_rpc_server_sent_bytes_total", (INFO,))] > 0
        handshake = ("method", "/swarm.Peer/Handshake")
        # over TLS the certificate proves the callee: no Handshake call (--insecure channels make one)
        assert after.get(("swarm_rpc_server_received_bytes_total", (handshake,)), 0) == 0
        assert after[("swarm_rpc_server_in_flight", ())] == 0
        assert client[("swarm_rpc_client_calls_total", (INFO, ("outcome", "ok")))] == 3
        assert client[("swarm_rpc_client_received_bytes_total", (INFO,))] == \
            after[("swarm_rpc_server_sent_bytes_total", (INFO,))]

        assert daemon.stop() == 0
    with socket.socket() as s:  # the endpoint went away with the peer
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_failed_calls_are_counted_as_errors(parse):
    port = free_port()
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), ready_timeout=60) as daemon:
        with Peer(client_mode=True) as caller:
            channel = caller.pool.get(daemon.addrs[0])
            with pytest.raises(InvalidRequest, match="malformed"):
                caller.run(channel.unary("/swarm.Peer/Info", b"\xff\xff garbage", timeout=30), timeout=60)
        after = parse(scrape(port))
        assert after[("swarm_rpc_server_calls_total", (INFO, ("outcome", "error")))] == 1
        assert daemon.stop() == 0
