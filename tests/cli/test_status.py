"""`swarm-peer status`: the swarm as a few peers see it, and the container probes (--self, --resolve)."""

import json
import os
import subprocess
import sys

from procs import PeerProcess

from swarm.core.identity import Identity

LOCAL = ("--listen", "/ip4/127.0.0.1/tcp/0")


def status(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    return subprocess.run([sys.executable, "-m", "swarm", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env={**full_env, **(env or {})}, check=False)


def peer_id(addr: str) -> str:
    return addr.rsplit("/", 1)[1]


def port(addr: str) -> str:
    return addr.split("/")[4]


def test_lists_the_peers_that_answer_and_the_ones_that_do_not():
    with PeerProcess(*LOCAL) as a, PeerProcess(*LOCAL) as b:
        dead = "/ip4/127.0.0.1/tcp/1"
        bare_b = f"/ip4/127.0.0.1/tcp/{port(b.addrs[0])}"  # no PeerID: learned from the handshake
        result = status("--initial-peers", a.addrs[0], bare_b, dead)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert out.startswith("peers: 2 answered, 1 unreachable")
        assert peer_id(a.addrs[0]) in out and peer_id(b.addrs[0]) in out and a.addrs[0] in out
        assert f"unreachable: {dead}" in out and "experts served by these peers: 0" in out

        result = status("--json", env={"SWARM_INITIAL_PEERS": f"{a.addrs[0]},{b.addrs[0]}"})
        assert result.returncode == 0, result.stderr
        view = json.loads(result.stdout)
        assert sorted(p["peer_id"] for p in view["peers"]) == sorted([peer_id(a.addrs[0]), peer_id(b.addrs[0])])
        assert all(p["role"] == "peer" and p["rtt_ms"] > 0 and p["addrs"] for p in view["peers"])
        assert view["unreachable"] == [] and view["experts"] == {}
        assert a.stop() == 0 and b.stop() == 0


def test_no_answer_is_exit_1_and_no_peers_named_is_exit_2():
    result = status("--initial-peers", "/ip4/127.0.0.1/tcp/1", "--timeout", "2")
    assert result.returncode == 1 and "peers: 0 answered, 1 unreachable" in result.stdout
    result = status()
    assert result.returncode == 2 and "--initial-peers" in result.stderr
    result = status("--initial-peers", "/ip4/1.2.3/tcp/1")
    assert result.returncode == 2 and "not a valid /ip4 host" in result.stderr


def test_self_probe_answers_for_a_serving_peer_and_fails_otherwise(tmp_path):
    key = tmp_path / "peer.key"
    with PeerProcess(*LOCAL, "--identity", str(key)) as daemon:
        p = port(daemon.addrs[0])
        env = {"SWARM_IDENTITY": str(key), "SWARM_LISTEN": f"/ip4/0.0.0.0/tcp/{p}"}
        result = status("--self", env=env)
        assert result.returncode == 0 and result.stdout.startswith(f"ok {peer_id(daemon.addrs[0])}"), result.stderr
        # another key on this port: the peer answering is not the one this container runs
        other = tmp_path / "other.key"
        other.write_bytes(Identity.generate().private_bytes())
        result = status("--self", env={**env, "SWARM_IDENTITY": str(other)})
        assert result.returncode == 1 and "unhealthy" in result.stderr and "Unauthenticated" in result.stderr
        assert daemon.stop() == 0
    result = status("--self", "--port", p, "--timeout", "2")
    assert result.returncode == 1 and "did not answer" in result.stderr


def test_resolve_appends_the_peer_id_learned_from_the_handshake():
    with PeerProcess(*LOCAL) as daemon:
        bare = f"/ip4/127.0.0.1/tcp/{port(daemon.addrs[0])}"
        result = status("--resolve", bare)
        assert result.returncode == 0 and result.stdout.strip() == daemon.addrs[0], result.stderr
        assert daemon.stop() == 0
    result = status("--resolve", "/ip4/127.0.0.1/tcp/1", "--wait", "0.5", "--timeout", "1")
    assert result.returncode == 1 and "no peer answered" in result.stderr


def test_lists_experts_by_prefix_through_the_dht():
    with PeerProcess(*LOCAL) as boot:
        with PeerProcess(*LOCAL, "--initial-peers", boot.addrs[0], "--experts", "ffn.[0:2].[0:2]",
                         "--expert-cls", "ffn", "--hidden-dim", "16", ready_timeout=60) as expert:
            result = status("--initial-peers", boot.addrs[0], "--prefix", "ffn.", "--prefix", "ffn.1.", "--json")
            assert result.returncode == 0, result.stderr
            view = json.loads(result.stdout)
            if not view["dht"]:
                return  # nothing to list without a DHT
            assert {p["peer_id"]: p["source"] for p in view["peers"]} == \
                {peer_id(boot.addrs[0]): "initial", peer_id(expert.addrs[0]): "dht"}
            assert view["dht_experts"] == {
                "ffn.": {uid: expert.addrs[0] for uid in ("ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1")},
                "ffn.1.": {uid: expert.addrs[0] for uid in ("ffn.1.0", "ffn.1.1")},
            }
            text = status("--initial-peers", boot.addrs[0], "--prefix", "ffn.").stdout
            assert "experts under 'ffn.' in the DHT: 4" in text and f"ffn.1.1  {expert.addrs[0]}" in text
            assert expert.stop(30) == 0
        assert boot.stop() == 0
