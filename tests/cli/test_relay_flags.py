"""`swarm-peer`'s reachability and relay flags (docs/relay.md), on real processes on loopback."""

from __future__ import annotations

import pytest
from procs import PeerProcess

from swarm.cli.config import build_parser, resolve
from swarm.core.errors import ConfigError
from swarm.core.multiaddr import Multiaddr


def test_flags_are_read_and_checked():
    options = resolve(build_parser().parse_args(["--relay", "off", "--reachability", "private",
                                                 "--relay-port", "31340"]), environ={})
    assert (options.relay, options.reachability, options.relay_port) == ("off", "private", 31340)
    assert resolve(build_parser().parse_args([]), environ={"SWARM_RELAY": "on"}).relay == "on"
    with pytest.raises(ConfigError, match="--relay must be auto, on or off"):
        resolve(build_parser().parse_args(["--relay", "maybe"]), environ={})
    with pytest.raises(ConfigError, match="--reachability"):
        resolve(build_parser().parse_args(["--reachability", "nat"]), environ={})


@pytest.mark.timeout(90)
def test_the_daemon_says_what_it_found_and_a_private_one_prints_its_relayed_address():
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0") as relay:
        private = PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", relay.addrs[0],
                              "--reachability", "private")
        public = PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", relay.addrs[0])
        with private, public:
            assert Multiaddr.parse(private.addrs[0]).relay_id == Multiaddr.parse(relay.addrs[0]).peer_id
            assert Multiaddr.parse(public.addrs[0]).relay_id is None
            assert private.stop() == 0 and public.stop() == 0
            private_log, public_log = private.stderr_text(), public.stderr_text()
    assert "reachability: private (as configured" in private_log and "reachable through 1 relay(s)" in private_log
    assert "reachability: public: dialed back by 1 of 1 peers; relaying" in public_log
